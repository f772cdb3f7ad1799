#include "serving/client/grpc_util.h"

#include <algorithm>
#include <cctype>
#include <cmath>

namespace mlarun::client_internal {
namespace {

// `seconds` from now, clamped to [0, cap] (not finite: cap), so huge values
// do not overflow the clock arithmetic.
std::chrono::system_clock::time_point SecondsFromNow(double seconds, double cap) {
  const double s = std::isfinite(seconds) ? std::clamp(seconds, 0.0, cap) : cap;
  return std::chrono::system_clock::now() +
         std::chrono::duration_cast<std::chrono::system_clock::duration>(std::chrono::duration<double>(s));
}

}  // namespace

Status CheckAddress(std::string_view address) {
  if (address.empty()) return InvalidArgumentError("the address is empty (want host:port)");
  for (std::string_view scheme : {"dns:", "ipv4:", "ipv6:", "unix:", "unix-abstract:"}) {
    if (address.substr(0, scheme.size()) == scheme) {
      if (address.size() == scheme.size())
        return InvalidArgumentError("'", address, "' names no target after the scheme");
      return Status::Ok();
    }
  }
  const size_t colon = address.rfind(':');
  if (colon == std::string_view::npos)
    return InvalidArgumentError("cannot parse address '", address, "': want host:port");
  std::string_view host = address.substr(0, colon);
  std::string_view port = address.substr(colon + 1);
  if (host.empty()) return InvalidArgumentError("cannot parse address '", address, "': the host is empty");
  // An IPv6 literal must be bracketed, or its own colons would be taken for the port's.
  if (host.find(':') != std::string_view::npos && !(host.front() == '[' && host.back() == ']'))
    return InvalidArgumentError("cannot parse address '", address, "': put IPv6 hosts in brackets, [::1]:50051");
  if (port.empty() || port.size() > 5 ||
      !std::all_of(port.begin(), port.end(), [](char c) { return std::isdigit(static_cast<unsigned char>(c)); }))
    return InvalidArgumentError("cannot parse address '", address, "': the port must be a number");
  const int p = std::stoi(std::string(port));
  if (p < 1 || p > 65535)
    return InvalidArgumentError("cannot parse address '", address, "': port ", p, " is out of range");
  return Status::Ok();
}

std::string_view GrpcCodeName(grpc::StatusCode code) {
  // grpc::StatusCode and StatusCode share their numbers (the canonical codes).
  return StatusCodeName(static_cast<StatusCode>(code));
}

std::shared_ptr<grpc::Channel> MakeChannel(const std::string& address, const TlsPem& tls) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 2000);
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  if (!tls.enabled()) return grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
  grpc::SslCredentialsOptions options;
  options.pem_root_certs = tls.ca;
  options.pem_private_key = tls.key;
  options.pem_cert_chain = tls.cert;
  return grpc::CreateCustomChannel(address, grpc::SslCredentials(options), args);
}

bool AwaitConnection(grpc::Channel& channel, double seconds) {
  return channel.WaitForConnected(SecondsFromNow(seconds, 60.0));
}

std::shared_ptr<grpc::Channel> ConnectChannel(const std::string& address, const TlsPem& tls, double call_timeout_s) {
  std::shared_ptr<grpc::Channel> channel = MakeChannel(address, tls);
  AwaitConnection(*channel, std::min(call_timeout_s, kConnectWait_s));
  return channel;
}

void AddCredentials(grpc::ClientContext& ctx, const ClientSecurity& security) {
  if (!security.token.empty()) ctx.AddMetadata(kAuthorizationHeader, BearerValue(security.token));
}

void SetDeadline(grpc::ClientContext& ctx, double timeout_s) {
  constexpr double kYear_s = 365.0 * 24 * 3600;
  ctx.set_deadline(SecondsFromNow(timeout_s, kYear_s));
}

}  // namespace mlarun::client_internal
