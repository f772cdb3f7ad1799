// Internal to serving/ and what stands on it: the client-side gRPC glue shared by `submit`,
// `stats`, `memory --measure`, the serving benchmark, the simulated worker and
// the worker link. Includes gRPC, so no public header may include it
// (gRPC stays out of public headers).
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <memory>
#include <string>
#include <string_view>

#include "base/status.h"
#include "serving/security/security.h"

namespace mlarun::client_internal {

// Checks that `address` is something gRPC can dial: host:port (port 1-65535,
// IPv6 hosts in brackets), or a target with a scheme (dns:, ipv4:, ipv6:,
// unix:). gRPC itself accepts nearly any string and only fails at connect
// time with a vague UNAVAILABLE, so a typo like "localhost" (no port) is
// caught here as bad usage instead.
Status CheckAddress(std::string_view address);

// The canonical name of a gRPC status code: "INVALID_ARGUMENT", ...
// (StatusCodeName of the same number; unknown numbers give "UNKNOWN").
std::string_view GrpcCodeName(grpc::StatusCode code);

// A channel whose reconnect back-off is 100 ms to 2 s (gRPC's default grows
// to 120 s, far too slow to notice a restarted coordinator) and which does
// not share subchannels with other channels of the process, so a fresh
// channel really opens a fresh connection. Plaintext, or TLS when
// `tls.enabled()` (trusting tls.ca only; tls.cert and tls.key, when set, are
// the client certificate).
std::shared_ptr<grpc::Channel> MakeChannel(const std::string& address, const TlsPem& tls = {});

// Waits up to `seconds` for `channel` to be connected; returns whether it is.
// A call that does not wait for ready fails with UNAVAILABLE as soon as one
// connection attempt fails, and gRPC 1.51 (Debian 12's) can fail an attempt
// to a server that is listening: it reads errno after other calls may have
// changed it, so a connect still in progress is reported as failed ("No such
// file or directory"). A channel that is still connecting retries after its
// back-off, so a client that makes one call waits here first; one that goes
// on after a false return gets gRPC's own error from its call.
bool AwaitConnection(grpc::Channel& channel, double seconds);

// How long a client about to make its calls waits for the connection (or
// its own timeout, when shorter).
inline constexpr double kConnectWait_s = 2.0;

// MakeChannel, then AwaitConnection for kConnectWait_s, or `call_timeout_s`
// (the timeout of the calls about to be made) when that is shorter. A
// channel that did not connect is returned all the same, so the first call
// reports gRPC's own error.
std::shared_ptr<grpc::Channel> ConnectChannel(const std::string& address, const TlsPem& tls = {},
                                              double call_timeout_s = kConnectWait_s);

// A call's context for the client API: `authorization: Bearer TOKEN` when
// the security has a token. The deadline is the caller's (SetDeadline).
void AddCredentials(grpc::ClientContext& ctx, const ClientSecurity& security);

// Sets a deadline `timeout_s` from now, clamped to a year so huge values do
// not overflow the clock arithmetic.
void SetDeadline(grpc::ClientContext& ctx, double timeout_s);

}  // namespace mlarun::client_internal
