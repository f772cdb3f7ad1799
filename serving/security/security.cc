#include "serving/security/security.h"

#include <openssl/evp.h>
#include <sys/random.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <vector>

namespace mlarun {
using internal::StrCat;
namespace {

constexpr size_t kMaxSecretBytes = 4096;
constexpr size_t kMinTokenBytes = 16;
// A token file of a few thousand principals is plenty; beyond this it is
// probably not a token file.
constexpr size_t kMaxTokenFileBytes = size_t{16} << 20;
constexpr char kWhitespace[] = " \t\r\n\v\f";

std::string_view Trim(std::string_view s) {
  const size_t first = s.find_first_not_of(kWhitespace);
  if (first == std::string_view::npos) return {};
  return s.substr(first, s.find_last_not_of(kWhitespace) - first + 1);
}

bool PrintableAscii(std::string_view s) {
  return std::all_of(s.begin(), s.end(), [](char c) { return c >= 0x20 && c <= 0x7e; });
}

// The whole file, or INVALID_ARGUMENT naming `flag` and `path`.
StatusOr<std::string> ReadWhole(std::string_view flag, const std::string& path, size_t max_bytes) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return InvalidArgumentError(flag, ": cannot read '", path, "': ", std::strerror(errno));
  std::ostringstream content;
  content << in.rdbuf();
  if (in.bad()) return InvalidArgumentError(flag, ": cannot read '", path, "'");
  std::string s = std::move(content).str();
  if (s.size() > max_bytes) return InvalidArgumentError(flag, ": '", path, "' is larger than ", max_bytes, " bytes");
  return s;
}

}  // namespace

StatusOr<std::string> ReadSecretFile(std::string_view flag, const std::string& path) {
  MLARUN_ASSIGN_OR_RETURN(const std::string content, ReadWhole(flag, path, kMaxSecretBytes));
  const std::string_view s = Trim(content);
  if (s.empty()) return InvalidArgumentError(flag, ": '", path, "' is empty");
  if (!PrintableAscii(s))
    return InvalidArgumentError(flag, ": '", path,
                                "' must hold printable ASCII only (it is sent as a gRPC metadata value)");
  return std::string(s);
}

bool ConstantTimeEqual(std::string_view a, std::string_view b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  const size_t n = std::max(a.size(), b.size());
  for (size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    const unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    diff |= x ^ y;
  }
  return diff == 0;
}

StatusOr<AuthTokens> AuthTokens::ReadFile(const std::string& path) {
  MLARUN_ASSIGN_OR_RETURN(const std::string text, ReadWhole("--auth-token-file", path, kMaxTokenFileBytes));
  return Parse(text, path);
}

StatusOr<AuthTokens> AuthTokens::Parse(std::string_view text, const std::string& path) {
  std::vector<Principal> principals;
  std::map<std::string, int, std::less<>> token_line, name_line;
  int line_no = 0;
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find('\n', start);
    if (end == std::string_view::npos) end = text.size();
    const std::string_view line = Trim(text.substr(start, end - start));
    start = end + 1;
    ++line_no;
    if (line.empty() || line.front() == '#') continue;
    const auto at = [&] { return StrCat("--auth-token-file: '", path, "' line ", line_no); };
    if (!PrintableAscii(line)) return InvalidArgumentError(at(), ": must be printable ASCII");
    const size_t gap = line.find_first_of(kWhitespace);
    Principal p;
    p.token = std::string(line.substr(0, gap));
    p.name = gap == std::string_view::npos ? StrCat("token-", line_no) : std::string(Trim(line.substr(gap)));
    if (p.name.find_first_of(kWhitespace) != std::string::npos)
      return InvalidArgumentError(at(), ": want TOKEN [NAME], the name without spaces; got more fields");
    if (p.token.size() < kMinTokenBytes)
      return InvalidArgumentError(at(), ": a token must be at least ", kMinTokenBytes, " characters, got ",
                                  p.token.size(), " (make one with `openssl rand -hex 32`)");
    if (p.token.size() > kMaxSecretBytes)
      return InvalidArgumentError(at(), ": a token must be at most ", kMaxSecretBytes, " characters");
    if (auto [it, fresh] = token_line.emplace(p.token, line_no); !fresh)
      return InvalidArgumentError(at(), ": the same token as line ", it->second);
    if (auto [it, fresh] = name_line.emplace(p.name, line_no); !fresh)
      return InvalidArgumentError(at(), ": the same principal name '", p.name, "' as line ", it->second);
    principals.push_back(std::move(p));
  }
  if (principals.empty()) return InvalidArgumentError("--auth-token-file: '", path, "' holds no token");
  return AuthTokens(std::move(principals));
}

const Principal* AuthTokens::Authenticate(std::string_view authorization) const {
  constexpr std::string_view kScheme = "bearer ";
  if (authorization.size() <= kScheme.size()) return nullptr;
  for (size_t i = 0; i < kScheme.size(); ++i) {
    if (std::tolower(static_cast<unsigned char>(authorization[i])) != kScheme[i]) return nullptr;
  }
  const std::string_view presented = Trim(authorization.substr(kScheme.size()));
  // Every token is compared, so the time says nothing about which one matched.
  const Principal* found = nullptr;
  for (const Principal& p : principals_) {
    if (ConstantTimeEqual(presented, p.token)) found = &p;
  }
  return found;
}

std::string BearerValue(std::string_view token) { return StrCat("Bearer ", token); }

StatusOr<std::string> ReadClientTokenFile(const std::string& path) {
  MLARUN_ASSIGN_OR_RETURN(const AuthTokens tokens, AuthTokens::ReadFile(path));
  return tokens.principals().front().token;
}

namespace {

StatusOr<std::string> ReadPem(std::string_view flag, const std::string& path) {
  if (path.empty()) return std::string();
  MLARUN_ASSIGN_OR_RETURN(std::string pem, ReadWhole(flag, path, size_t{1} << 20));
  if (pem.find("-----BEGIN") == std::string::npos)
    return InvalidArgumentError(flag, ": '", path, "' holds no PEM block (-----BEGIN ...)");
  return pem;
}

StatusOr<TlsPem> ReadTls(const TlsFiles& files) {
  if (files.cert.empty() != files.key.empty())
    return InvalidArgumentError(files.cert.empty() ? "--tls-key needs --tls-cert" : "--tls-cert needs --tls-key",
                                " (a certificate and its private key)");
  TlsPem pem;
  MLARUN_ASSIGN_OR_RETURN(pem.cert, ReadPem("--tls-cert", files.cert));
  MLARUN_ASSIGN_OR_RETURN(pem.key, ReadPem("--tls-key", files.key));
  MLARUN_ASSIGN_OR_RETURN(pem.ca, ReadPem("--tls-ca", files.ca));
  return pem;
}

}  // namespace

StatusOr<TlsPem> LoadServerTls(const TlsFiles& files) {
  if (!files.ca.empty() && files.cert.empty())
    return InvalidArgumentError(
        "--tls-ca needs --tls-cert and --tls-key: the coordinator verifies workers' client "
        "certificates only over TLS");
  return ReadTls(files);
}

StatusOr<TlsPem> LoadClientTls(const TlsFiles& files) {
  if (!files.cert.empty() && files.ca.empty())
    return InvalidArgumentError("--tls-cert needs --tls-ca: the CA that signed the coordinator's certificate");
  return ReadTls(files);
}

uint64_t PrefixCacheSalt(std::string_view principal, std::string_view cache_salt) {
  if (principal.empty() && cache_salt.empty()) return 0;
  // Length-prefixed, so that no two (principal, cache_salt) pairs hash the
  // same bytes.
  std::string message = "mlarun prefix cache salt";
  for (std::string_view part : {principal, cache_salt}) {
    const uint64_t n = part.size();
    for (int i = 0; i < 8; ++i) message.push_back(static_cast<char>(n >> (8 * i)));
    message.append(part);
  }
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int digest_len = 0;
  if (EVP_Digest(message.data(), message.size(), digest, &digest_len, EVP_sha256(), nullptr) != 1 || digest_len < 8) {
    // Not seen: SHA-256 is built into libcrypto. A random salt shares
    // nothing, rather than something with the wrong requests.
    std::random_device device;
    return (uint64_t{device()} << 32 | device()) | 1;
  }
  uint64_t salt = 0;
  for (int i = 0; i < 8; ++i) salt |= uint64_t{digest[i]} << (8 * i);
  return salt != 0 ? salt : 1;
}

std::string RandomHex(size_t n) {
  std::vector<unsigned char> bytes(n);
  size_t got = 0;
  while (got < bytes.size()) {
    const ssize_t n = getrandom(bytes.data() + got, bytes.size() - got, 0);
    if (n > 0) {
      got += static_cast<size_t>(n);
    } else if (n < 0 && errno != EINTR) {
      // Not seen on Linux >= 3.17 (getrandom blocks until the pool is seeded
      // and fails only with EINTR); std::random_device reads the same pool
      // (or the CPU's RDRAND) another way.
      std::random_device device;
      for (; got < bytes.size(); ++got) bytes[got] = static_cast<unsigned char>(device());
    }
  }
  static constexpr char kHex[] = "0123456789abcdef";
  std::string hex;
  hex.reserve(2 * n);
  for (const unsigned char b : bytes) {
    hex.push_back(kHex[b >> 4]);
    hex.push_back(kHex[b & 15]);
  }
  return hex;
}

std::string NewRandomRequestId() { return "req-" + RandomHex(16); }

}  // namespace mlarun
