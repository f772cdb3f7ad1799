#include "transfer/block_transfer.h"

#include <poll.h>
#include <ucp/api/ucp.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <string>

namespace mlarun {
namespace {

using Clock = std::chrono::steady_clock;

// The descriptor: a fixed header, then the remote key and the worker
// address. Fields in the host's byte order: peers of one deployment run on
// the same architecture.
constexpr uint32_t kMagic = 0x54424c4d;  // "MLBT"
constexpr uint32_t kVersion = 1;
struct Header {
  uint32_t magic, version;
  int64_t num_layers, kv_lora_rank, rope_dim, block_size;
  int32_t dtype, reserved;
  int64_t num_blocks;
  uint64_t base;
  uint32_t rkey_bytes, address_bytes;
};

Status UcxError(std::string_view what, ucs_status_t st) {
  return UnavailableError("UCX ", what, ": ", ucs_status_string(st));
}

// A UCX context for one-sided gets on the path's transports.
StatusOr<ucp_context_h> MakeContext(TransferPath path) {
  ucp_config_t* config = nullptr;
  if (ucs_status_t st = ucp_config_read(nullptr, nullptr, &config); st != UCS_OK) return UcxError("config", st);
  if (path == TransferPath::kSharedMemory)
    if (ucs_status_t st = ucp_config_modify(config, "TLS", "sm,self"); st != UCS_OK) {
      ucp_config_release(config);
      return UcxError("shared-memory transports", st);
    }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  // WAKEUP: a source waits for its peers' messages on the worker's event
  // fd (ArmForWakeup) instead of polling.
  params.features = UCP_FEATURE_RMA | UCP_FEATURE_WAKEUP;
  ucp_context_h context = nullptr;
  const ucs_status_t init = ucp_init(&params, config, &context);
  ucp_config_release(config);
  if (init != UCS_OK) return UcxError("init", init);
  return context;
}

// Bytes of one block of one layer, and of one layer of a pool of `blocks`.
int64_t LayerBlockBytes(const LatentCacheConfig& c) {
  return c.block_size * (c.kv_lora_rank + c.rope_dim) * static_cast<int64_t>(DTypeSize(c.dtype));
}

// Runs of consecutive ids in both src and dst: [src0, dst0, count].
struct Run {
  int64_t src, dst, count;
};
std::vector<Run> Runs(std::span<const int32_t> src, std::span<const int32_t> dst) {
  std::vector<Run> runs;
  for (size_t i = 0; i < src.size(); ++i) {
    if (!runs.empty() && runs.back().src + runs.back().count == src[i] &&
        runs.back().dst + runs.back().count == dst[i]) {
      ++runs.back().count;
    } else {
      runs.push_back({src[i], dst[i], 1});
    }
  }
  return runs;
}

}  // namespace

struct BlockTransfer::Ucx {
  struct Peer {
    ucp_ep_h ep = nullptr;
    ucp_rkey_h rkey = nullptr;
    uint64_t base = 0;
    int64_t num_blocks = 0;
    bool failed = false;
    bool peer_errors = true;        // UCP_ERR_HANDLING_MODE_PEER (kAny)
    uint64_t probe = 0;             // kSharedMemory: WaitConnected's word
    void* probe_request = nullptr;  // its request, where it timed out
  };

  ucp_context_h context = nullptr;
  bool own_context = true;  // else a TransferMemory's, with the pool's registration
  ucp_worker_h worker = nullptr;
  ucp_mem_h memory = nullptr;
  void* rkey_buffer = nullptr;
  size_t rkey_bytes = 0;
  ucp_address_t* address = nullptr;
  size_t address_bytes = 0;
  int event_fd = -1;  // the worker's (ucp_worker_get_efd); -1 where the transports cannot wake anyone
  std::vector<std::unique_ptr<Peer>> peers;  // stable addresses: the error handler's argument

  ~Ucx() {
    for (auto& p : peers) {  // no get is outstanding here: the key first, as UCX asks
      DropKey(*p);
      CloseEndpoint(*p);
    }
    if (address != nullptr) ucp_worker_release_address(worker, address);
    if (rkey_buffer != nullptr) ucp_rkey_buffer_release(rkey_buffer);
    if (memory != nullptr && own_context) ucp_mem_unmap(context, memory);
    if (worker != nullptr) ucp_worker_destroy(worker);
    if (context != nullptr && own_context) ucp_cleanup(context);
  }

  static void OnPeerError(void* arg, ucp_ep_h, ucs_status_t) { static_cast<Peer*>(arg)->failed = true; }

  // Closes a peer's endpoint, and waits until UCX has let go of it: at once
  // with peer failure handling (which ends its outstanding gets with an
  // error), else after its gets (kSharedMemory: copies that always end). The
  // peer is failed from then on.
  void CloseEndpoint(Peer& p) {
    p.failed = true;
    if (p.probe_request != nullptr) {     // a handshake that never ended: closing would wait for the source
      ucp_request_free(p.probe_request);  // UCX frees it when it ends;
      p.probe_request = nullptr;          // ucp_worker_destroy takes the endpoint
      p.ep = nullptr;
    }
    if (p.ep == nullptr) return;
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = p.peer_errors ? UCP_EP_CLOSE_FLAG_FORCE : 0;
    void* req = ucp_ep_close_nbx(p.ep, &param);
    if (UCS_PTR_IS_PTR(req)) {
      while (ucp_request_check_status(req) == UCS_INPROGRESS) ucp_worker_progress(worker);
      ucp_request_free(req);
    }
    p.ep = nullptr;
  }
  // Releases the peer's remote key, once no get uses it.
  static void DropKey(Peer& p) {
    if (p.rkey != nullptr) ucp_rkey_destroy(p.rkey);
    p.rkey = nullptr;
  }
};

BlockTransfer::BlockTransfer(const LatentPool& pool, const BlockTransferOptions& options)
    : pool_(pool), options_(options), ucx_(std::make_unique<Ucx>()) {}
BlockTransfer::~BlockTransfer() = default;

struct TransferMemory::Ucx {
  ucp_context_h context = nullptr;
  struct Block {
    ucp_mem_h handle;
    size_t bytes;
  };
  std::map<const void*, Block> blocks;  // by address: what Allocate gave out
};

TransferMemory::TransferMemory(const BlockTransferOptions& options)
    : options_(options), ucx_(std::make_unique<Ucx>()) {}
TransferMemory::~TransferMemory() {
  for (auto& [p, b] : ucx_->blocks) ucp_mem_unmap(ucx_->context, b.handle);
  if (ucx_->context != nullptr) ucp_cleanup(ucx_->context);
}

StatusOr<std::unique_ptr<TransferMemory>> TransferMemory::Create(const BlockTransferOptions& options) {
  std::unique_ptr<TransferMemory> m(new TransferMemory(options));
  MLARUN_ASSIGN_OR_RETURN(m->ucx_->context, MakeContext(options.path));
  return m;
}

void* TransferMemory::Allocate(size_t bytes) {
  ucp_mem_map_params_t mp{};
  mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH | UCP_MEM_MAP_PARAM_FIELD_FLAGS;
  mp.address = nullptr;
  mp.length = bytes == 0 ? 1 : bytes;
  mp.flags = UCP_MEM_MAP_ALLOCATE;
  ucp_mem_h handle = nullptr;
  if (ucp_mem_map(ucx_->context, &mp, &handle) != UCS_OK) return nullptr;
  ucp_mem_attr_t attr{};
  attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS;
  if (ucp_mem_query(handle, &attr) != UCS_OK || reinterpret_cast<uintptr_t>(attr.address) % 64 != 0) {
    ucp_mem_unmap(ucx_->context, handle);
    return nullptr;
  }
  ucx_->blocks[attr.address] = {handle, bytes};
  return attr.address;
}

void TransferMemory::Free(void* p) {
  auto it = ucx_->blocks.find(p);
  if (it == ucx_->blocks.end()) return;
  ucp_mem_unmap(ucx_->context, it->second.handle);
  ucx_->blocks.erase(it);
}

Status TransferMemory::CopyIn(void* dst, const void* src, size_t bytes) {
  if (bytes > 0) std::memcpy(dst, src, bytes);
  return Status::Ok();
}
Status TransferMemory::CopyOut(void* dst, const void* src, size_t bytes) { return CopyIn(dst, src, bytes); }
Status TransferMemory::Zero(void* dst, size_t bytes) {
  if (bytes > 0) std::memset(dst, 0, bytes);
  return Status::Ok();
}

StatusOr<std::unique_ptr<BlockTransfer>> BlockTransfer::Create(const LatentPool& pool,
                                                               const BlockTransferOptions& options,
                                                               TransferMemory* memory) {
  std::unique_ptr<BlockTransfer> t(new BlockTransfer(pool, options));
  Ucx& u = *t->ucx_;
  if (memory != nullptr) {  // the pool's allocation, registered by UCX when it made it
    if (memory->options().path != options.path)
      return InvalidArgumentError("the pool's TransferMemory was made for another path");
    const auto it = memory->ucx_->blocks.find(pool.LayerData(0));
    if (it == memory->ucx_->blocks.end() || it->second.bytes < static_cast<size_t>(pool.bytes()))
      return InvalidArgumentError("the pool's memory is not an allocation of this TransferMemory");
    u.context = memory->ucx_->context, u.own_context = false, u.memory = it->second.handle;
  } else {
    MLARUN_ASSIGN_OR_RETURN(u.context, MakeContext(options.path));
  }
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SINGLE;
  if (ucs_status_t st = ucp_worker_create(u.context, &wp, &u.worker); st != UCS_OK) return UcxError("worker", st);
  ucp_mem_map_params_t mp{};
  mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
  mp.address = pool.LayerData(0);  // the pool's one allocation starts with layer 0
  mp.length = static_cast<size_t>(pool.bytes());
  if (u.memory == nullptr)
    if (ucs_status_t st = ucp_mem_map(u.context, &mp, &u.memory); st != UCS_OK)
      return UcxError("registering the pool (" + std::to_string(pool.bytes()) + " bytes)", st);
  if (ucs_status_t st = ucp_rkey_pack(u.context, u.memory, &u.rkey_buffer, &u.rkey_bytes); st != UCS_OK)
    return UcxError("packing the pool's key", st);
  if (ucs_status_t st = ucp_worker_get_address(u.worker, &u.address, &u.address_bytes); st != UCS_OK)
    return UcxError("worker address", st);
  if (ucp_worker_get_efd(u.worker, &u.event_fd) != UCS_OK) u.event_fd = -1;
  return t;
}

std::vector<std::byte> BlockTransfer::Descriptor() const {
  const LatentCacheConfig& c = pool_.config();
  const Header h{.magic = kMagic,
                 .version = kVersion,
                 .num_layers = c.num_layers,
                 .kv_lora_rank = c.kv_lora_rank,
                 .rope_dim = c.rope_dim,
                 .block_size = c.block_size,
                 .dtype = static_cast<int32_t>(c.dtype),
                 .reserved = 0,
                 .num_blocks = pool_.num_blocks(),
                 .base = reinterpret_cast<uint64_t>(pool_.LayerData(0)),
                 .rkey_bytes = static_cast<uint32_t>(ucx_->rkey_bytes),
                 .address_bytes = static_cast<uint32_t>(ucx_->address_bytes)};
  std::vector<std::byte> out(sizeof h + h.rkey_bytes + h.address_bytes);
  std::memcpy(out.data(), &h, sizeof h);
  std::memcpy(out.data() + sizeof h, ucx_->rkey_buffer, h.rkey_bytes);
  std::memcpy(out.data() + sizeof h + h.rkey_bytes, ucx_->address, h.address_bytes);
  return out;
}

StatusOr<int> BlockTransfer::Connect(std::span<const std::byte> descriptor) {
  Header h;
  if (descriptor.size() < sizeof h)
    return InvalidArgumentError("block transfer descriptor of ", descriptor.size(), " bytes: shorter than its header");
  std::memcpy(&h, descriptor.data(), sizeof h);
  if (h.magic != kMagic || h.version != kVersion)
    return InvalidArgumentError("not a block transfer descriptor (version ", kVersion, ")");
  if (descriptor.size() != sizeof h + size_t{h.rkey_bytes} + h.address_bytes)
    return InvalidArgumentError("block transfer descriptor of ", descriptor.size(), " bytes, its header says ",
                                sizeof h + size_t{h.rkey_bytes} + h.address_bytes);
  const LatentCacheConfig& c = pool_.config();
  const std::pair<const char*, std::pair<int64_t, int64_t>> fields[] = {
      {"num_layers", {h.num_layers, c.num_layers}},
      {"kv_lora_rank", {h.kv_lora_rank, c.kv_lora_rank}},
      {"rope_dim", {h.rope_dim, c.rope_dim}},
      {"block_size", {h.block_size, c.block_size}},
      {"dtype", {h.dtype, static_cast<int32_t>(c.dtype)}}};
  for (const auto& [name, values] : fields)
    if (values.first != values.second)
      return InvalidArgumentError("the peer's latent cache has ", name, " ", values.first, ", this one ", values.second,
                                  ": blocks cannot move between them");
  if (h.num_blocks <= 0) return InvalidArgumentError("the peer's latent cache has ", h.num_blocks, " blocks");
  Ucx& u = *ucx_;
  auto peer = std::make_unique<Ucx::Peer>();
  peer->base = h.base;
  peer->num_blocks = h.num_blocks;
  // The worker address is copied out: UCX reads it while connecting.
  std::vector<std::byte> address(descriptor.begin() + static_cast<ptrdiff_t>(sizeof h + h.rkey_bytes),
                                 descriptor.end());
  ucp_ep_params_t ep{};
  ep.field_mask =
      UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
  ep.address = reinterpret_cast<const ucp_address_t*>(address.data());
  const bool peer_errors = options_.path == TransferPath::kAny;
  peer->peer_errors = peer_errors;
  ep.err_mode = peer_errors ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
  ep.err_handler.cb = &Ucx::OnPeerError;
  ep.err_handler.arg = peer.get();
  if (ucs_status_t st = ucp_ep_create(u.worker, &ep, &peer->ep); st != UCS_OK) return UcxError("connecting", st);
  std::vector<std::byte> rkey(descriptor.begin() + sizeof h, descriptor.begin() + sizeof h + h.rkey_bytes);
  if (ucs_status_t st = ucp_ep_rkey_unpack(peer->ep, rkey.data(), &peer->rkey); st != UCS_OK) {
    u.CloseEndpoint(*peer);
    return UcxError("unpacking the peer's key", st);
  }
  u.peers.push_back(std::move(peer));
  const int id = static_cast<int>(u.peers.size() - 1);
  if (!peer_errors) MLARUN_RETURN_IF_ERROR(WaitConnected(id));
  return id;
}

// kSharedMemory: a get of the source pool's first bytes into a word of our
// own, so the connection is up before any get may write into the pool (a
// get queued behind the handshake would otherwise land whenever the source
// answers). Past the timeout the peer is failed, and the probe's request
// stays with the peer until the destructor.
Status BlockTransfer::WaitConnected(int id) {
  Ucx& u = *ucx_;
  Ucx::Peer& p = *u.peers[static_cast<size_t>(id)];
  ucp_request_param_t param{};
  void* req = ucp_get_nbx(p.ep, &p.probe, sizeof p.probe, p.base, p.rkey, &param);
  if (UCS_PTR_IS_ERR(req)) {
    p.failed = true;
    return UcxError("connecting", UCS_PTR_STATUS(req));
  }
  const Clock::time_point deadline = Clock::now() + options_.connect_timeout;
  while (req != nullptr && ucp_request_check_status(req) == UCS_INPROGRESS) {
    if (Clock::now() > deadline) {
      p.failed = true;
      p.probe_request = req;
      return Status(StatusCode::kDeadlineExceeded, "the peer did not answer within " +
                                                       std::to_string(options_.connect_timeout.count()) +
                                                       " ms (does it call Progress?)");
    }
    ucp_worker_progress(u.worker);
  }
  if (req == nullptr) return Status::Ok();
  const ucs_status_t st = ucp_request_check_status(req);
  ucp_request_free(req);
  if (st != UCS_OK) {
    p.failed = true;
    return UcxError("connecting", st);
  }
  return Status::Ok();
}

bool BlockTransfer::Progress() { return ucp_worker_progress(ucx_->worker) != 0; }

BlockTransfer::Wakeup BlockTransfer::ArmForWakeup() {
  Ucx& u = *ucx_;
  if (u.event_fd < 0) return {};
  while (ucp_worker_progress(u.worker) != 0) {
  }
  const ucs_status_t st = ucp_worker_arm(u.worker);
  if (st == UCS_OK) return {.fd = u.event_fd};
  return {.busy = st == UCS_ERR_BUSY};
}

void BlockTransfer::AnswerPeers(std::chrono::microseconds most) {
  const Wakeup w = ArmForWakeup();
  if (w.fd >= 0) {
    WaitForWakeup(w.fd, most);
  } else if (!w.busy) {
    Progress();
  }
}

bool WaitForWakeup(int fd, std::chrono::microseconds most) {
  pollfd p{.fd = fd, .events = POLLIN, .revents = 0};
  const auto s = std::chrono::duration_cast<std::chrono::seconds>(most);
  const timespec ts{.tv_sec = static_cast<time_t>(s.count()),
                    .tv_nsec = static_cast<long>(std::chrono::nanoseconds(most - s).count())};
  return ppoll(&p, 1, &ts, nullptr) > 0;
}

namespace {

// The checks Fetch makes before any get.
Status CheckFetch(std::span<const int32_t> src, std::span<const int32_t> dst, int64_t src_blocks, int64_t dst_blocks) {
  if (src.size() != dst.size())
    return InvalidArgumentError("fetch of ", src.size(), " source blocks into ", dst.size(), " destination blocks");
  std::vector<bool> taken(static_cast<size_t>(dst_blocks));
  for (size_t i = 0; i < src.size(); ++i) {
    if (src[i] < 0 || src[i] >= src_blocks)
      return OutOfRangeError("source block ", src[i], " (entry ", i, ") outside the peer's ", src_blocks, " blocks");
    if (dst[i] < 0 || dst[i] >= dst_blocks)
      return OutOfRangeError("destination block ", dst[i], " (entry ", i, ") outside this pool's ", dst_blocks,
                             " blocks");
    if (taken[static_cast<size_t>(dst[i])])
      return InvalidArgumentError("destination block ", dst[i], " named twice (entry ", i, ")");
    taken[static_cast<size_t>(dst[i])] = true;
  }
  return Status::Ok();
}

}  // namespace

Status BlockTransfer::Fetch(int peer_id, std::span<const int32_t> src, std::span<const int32_t> dst,
                            std::chrono::milliseconds timeout) {
  Ucx& u = *ucx_;
  if (peer_id < 0 || peer_id >= static_cast<int>(u.peers.size()))
    return InvalidArgumentError("no peer ", peer_id, " (", u.peers.size(), " connected)");
  Ucx::Peer& p = *u.peers[static_cast<size_t>(peer_id)];
  if (p.failed || p.ep == nullptr) return UnavailableError("peer ", peer_id, " failed or was closed: connect again");
  MLARUN_RETURN_IF_ERROR(CheckFetch(src, dst, p.num_blocks, pool_.num_blocks()));
  const LatentCacheConfig& c = pool_.config();
  const int64_t block_bytes = LayerBlockBytes(c);
  auto* local = static_cast<std::byte*>(pool_.LayerData(0));
  const std::vector<Run> runs = Runs(src, dst);
  std::vector<void*> pending;
  Status status;
  ucp_request_param_t param{};
  for (int64_t layer = 0; layer < c.num_layers && status.ok(); ++layer)
    for (const Run& r : runs) {
      std::byte* to = local + (layer * pool_.num_blocks() + r.dst) * block_bytes;
      const uint64_t from = p.base + static_cast<uint64_t>((layer * p.num_blocks + r.src) * block_bytes);
      void* req = ucp_get_nbx(p.ep, to, static_cast<size_t>(r.count * block_bytes), from, p.rkey, &param);
      ++stats_.gets;
      if (UCS_PTR_IS_ERR(req)) {
        status = UcxError("get", UCS_PTR_STATUS(req));
        break;
      }
      if (req != nullptr) pending.push_back(req);
    }
  // Every issued get ends here, complete, failed or cancelled.
  const Clock::time_point deadline = Clock::now() + timeout;
  while (!pending.empty()) {
    ucp_worker_progress(u.worker);
    std::erase_if(pending, [&](void* req) {
      const ucs_status_t st = ucp_request_check_status(req);
      if (st == UCS_INPROGRESS) return false;
      if (st != UCS_OK && status.ok()) status = UcxError("get", st);
      ucp_request_free(req);
      return true;
    });
    if (pending.empty()) break;
    if (p.failed && status.ok()) status = UnavailableError("peer ", peer_id, " failed during a fetch");
    if (p.peer_errors && Clock::now() > deadline && status.ok())
      status = Status(StatusCode::kDeadlineExceeded, "fetch of " + std::to_string(src.size()) + " blocks from peer " +
                                                         std::to_string(peer_id) + " took more than " +
                                                         std::to_string(timeout.count()) + " ms");
    if (!status.ok() && p.peer_errors) u.CloseEndpoint(p);  // ends what is left; the loop then collects it
  }
  if (!status.ok()) {
    u.DropKey(p);
    u.CloseEndpoint(p);
    ++stats_.failures;
    return status;
  }
  ++stats_.fetches;
  stats_.blocks += static_cast<int64_t>(src.size());
  stats_.bytes += static_cast<int64_t>(src.size()) * c.num_layers * block_bytes;
  return Status::Ok();
}

}  // namespace mlarun
