// The serving path's security settings, apart from gRPC: the worker link's
// shared secret, the client API's bearer tokens (one principal each), TLS
// certificates, and unguessable request ids. Every secret is read from a file
// (never from the command line, where `ps` shows it to every user).
//
// What each flag does (docs/security.md):
//   coordinator --worker-secret-file F   workers must send the secret in F
//               --auth-token-file F      clients must send one of F's tokens
//               --tls-cert C --tls-key K TLS on the coordinator's port
//               --tls-ca A               ... and worker client certificates
//                                        signed by A authenticate a worker
//   clients     --auth-token-file F      send F's token (`authorization: Bearer`)
//               --tls-ca A               TLS, trusting the coordinator's cert by A
//   workers     --worker-secret-file F, --tls-ca A [--tls-cert C --tls-key K]
//
// No gRPC header is visible here.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"

namespace mlarun {

// The content of a small secret file (`flag` names it in errors: the worker
// secret, a client's token): surrounding whitespace trimmed. INVALID_ARGUMENT
// naming the flag and the file when it cannot be read, is empty, is larger
// than 4 KiB, or holds anything but printable ASCII (it travels as a gRPC
// metadata value).
StatusOr<std::string> ReadSecretFile(std::string_view flag, const std::string& path);

// Equal in time independent of where they differ (their lengths may leak).
bool ConstantTimeEqual(std::string_view a, std::string_view b);

// The client API's tokens (`--auth-token-file` of the coordinator): one token
// per line, optionally followed by whitespace and the principal's name (its
// default is "token-<line number>"); blank lines and lines starting with '#'
// are skipped. A token is 16 to 4096 printable ASCII characters without
// spaces; a duplicate token or name is an error naming both lines.
struct Principal {
  std::string token;
  std::string name;
};
class AuthTokens {
 public:
  AuthTokens() = default;  // none: the client API is open
  explicit AuthTokens(std::vector<Principal> principals) : principals_(std::move(principals)) {}
  static StatusOr<AuthTokens> ReadFile(const std::string& path);
  // Parses a file's text; `path` names it in messages.
  static StatusOr<AuthTokens> Parse(std::string_view text, const std::string& path);

  bool empty() const { return principals_.empty(); }
  size_t size() const { return principals_.size(); }
  const std::vector<Principal>& principals() const { return principals_; }
  // The principal whose token is `authorization` ("Bearer TOKEN", the scheme
  // case-insensitive), compared in constant time with every token; nullptr
  // for none.
  const Principal* Authenticate(std::string_view authorization) const;

 private:
  std::vector<Principal> principals_;
};

// A client's token (`--auth-token-file` of submit, stats, memory): the first
// token of a file in the coordinator's format, so that one file holding one
// line serves both sides (the Slurm and Kubernetes recipes make one).
StatusOr<std::string> ReadClientTokenFile(const std::string& path);

// The header a client sends its token in, and its value.
inline constexpr char kAuthorizationHeader[] = "authorization";
std::string BearerValue(std::string_view token);

// PEM files of one end of a TLS connection (`--tls-cert`, `--tls-key`,
// `--tls-ca`), as paths and as their contents.
struct TlsFiles {
  std::string cert, key, ca;
  bool any() const { return !cert.empty() || !key.empty() || !ca.empty(); }
};
struct TlsPem {
  std::string cert, key, ca;
  // A server: cert and key set. A client: TLS when this is true (ca set;
  // cert and key: a client certificate).
  bool enabled() const { return !cert.empty() || !ca.empty(); }
};
// The server's: cert and key both or neither; ca only with them (a CA
// without a server certificate cannot verify anything). The client's: cert
// and key both or neither, and only with ca (TLS trusts only the CA it is
// given). Errors name the flag and the file; each file must hold a PEM
// block ("-----BEGIN").
StatusOr<TlsPem> LoadServerTls(const TlsFiles& files);
StatusOr<TlsPem> LoadClientTls(const TlsFiles& files);

// What a client of the coordinator sends besides its requests.
struct ClientSecurity {
  TlsPem tls;         // TLS when tls.enabled()
  std::string token;  // the client API's bearer token; empty: none
};

// A request's prefix-cache salt (RouteRequest.prefix_cache_salt,
// kv/prefix_hash.h): requests reuse each other's cached prefixes only when
// their salts are equal. 0 (unsalted, shared by all) when `principal` and
// `cache_salt` are both empty; otherwise the first 8 bytes of SHA-256 over
// both, each length-prefixed, and never 0. A cryptographic hash, so that no
// client can choose a cache_salt that gives another principal's salt.
uint64_t PrefixCacheSalt(std::string_view principal, std::string_view cache_salt);
// The longest cache_salt a request may carry.
inline constexpr size_t kMaxCacheSaltBytes = 256;

// `n` bytes of getrandom(2) as 2n lowercase hex digits (secrets, ids).
std::string RandomHex(size_t n);

// A request id no other client can guess: "req-" and 32 hex digits of
// getrandom(2) (128 bits).
std::string NewRandomRequestId();

}  // namespace mlarun
