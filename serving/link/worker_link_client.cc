#include "serving/link/worker_link_client.h"

#include <algorithm>
#include <utility>

#include "serving/client/grpc_util.h"

namespace mlarun {
namespace {

constexpr auto kMinBackoff = std::chrono::milliseconds(100);
constexpr auto kMaxBackoff = std::chrono::milliseconds(2000);

}  // namespace

WorkerLinkClient::WorkerLinkClient(Options o)
    : coordinator_(std::move(o.coordinator)),
      reconnect_(o.reconnect),
      secret_(std::move(o.secret)),
      tls_(std::move(o.tls)),
      registration_(std::move(o.registration)) {
  thread_ = std::thread([this] { Run(); });
}

WorkerLinkClient::~WorkerLinkClient() {
  {
    // Under mu_, so Run either sees stopping_ before it connects or has
    // published its context for us to cancel.
    MutexLock lock(mu_);
    stopping_ = true;
    if (context_) context_->TryCancel();
    changed_.notify_all();
  }
  thread_.join();
}

std::deque<WorkerLinkEvent> WorkerLinkClient::Drain() {
  MutexLock lock(mu_);
  drained_ = true;
  std::deque<WorkerLinkEvent> out;
  out.swap(inbox_);
  changed_.notify_all();  // Run may wait for the inbox to empty before reconnecting
  return out;
}

void WorkerLinkClient::WaitUntil(Clock::time_point until) {
  MutexLock lock(mu_);
  lock.WaitFor(changed_, until - Clock::now(), [this]() MLARUN_REQUIRES(mu_) { return !inbox_.empty() || woken_; });
  woken_ = false;
}

void WorkerLinkClient::Wake() {
  MutexLock lock(mu_);
  woken_ = true;
  changed_.notify_all();
}

bool WorkerLinkClient::Send(const v1::WorkerMessage& m) { return Write(&m, /*any=*/false); }

void WorkerLinkClient::UpdateRanks(const google::protobuf::RepeatedPtrField<v1::RankStats>& ranks) {
  MutexLock lock(mu_);
  *registration_.mutable_ranks() = ranks;
}

bool WorkerLinkClient::Leave(const std::string& reason, double timeout_s) {
  {
    MutexLock lock(mu_);
    leaving_ = true;
  }
  v1::WorkerMessage m;
  m.mutable_leaving()->set_reason(reason);
  if (!Write(reason.empty() ? nullptr : &m, /*any=*/true)) return false;
  MutexLock lock(mu_);
  return lock.WaitFor(changed_, std::chrono::duration<double>(timeout_s),
                      [this]() MLARUN_REQUIRES(mu_) { return context_ == nullptr; });
}

bool WorkerLinkClient::Write(const v1::WorkerMessage* m, bool any) {
  // write_mu_ first: Run takes it after resetting stream_, so a write that
  // copied the stream has finished before Run calls Finish on it.
  MutexLock lock(write_mu_);
  std::shared_ptr<Stream> s;
  {
    MutexLock l(mu_);
    if (drained_ || any) s = stream_;
  }
  if (s == nullptr) return false;
  return m != nullptr ? s->Write(*m) : s->WritesDone();
}

void WorkerLinkClient::Push(WorkerLinkEvent e) {
  inbox_.push_back(std::move(e));
  changed_.notify_all();
}

void WorkerLinkClient::Run() {
  std::chrono::milliseconds backoff = kMinBackoff;
  for (;;) {
    auto context = std::make_shared<grpc::ClientContext>();
    if (!secret_.empty()) context->AddMetadata(kWorkerSecretHeader, secret_);
    v1::WorkerMessage hello;
    {
      MutexLock lock(mu_);
      if (stopping_ || leaving_) return;
      *hello.mutable_register_() = registration_;
      context_ = context;  // published before Connect can block
    }
    // A fresh channel per attempt: its connection starts now instead of
    // whenever an old channel's own back-off allows.
    auto stub = v1::WorkerLink::NewStub(client_internal::MakeChannel(coordinator_, tls_));
    std::shared_ptr<Stream> stream(stub->Connect(context.get()));
    WorkerLinkEvent end{.ended = true};
    v1::CoordinatorMessage in;
    if (stream->Write(hello) && stream->Read(&in)) {
      end.registered = in.has_registered();
      if (!end.registered) context->TryCancel();  // not a coordinator's answer: Finish would wait forever
    }
    if (end.registered) {
      backoff = kMinBackoff;
      {
        MutexLock lock(mu_);
        stream_ = stream;
        drained_ = false;
        Push({.message = std::exchange(in, {})});
      }
      while (stream->Read(&in)) {
        MutexLock lock(mu_);
        Push({.message = std::exchange(in, {})});
      }
      MutexLock lock(mu_);
      stream_.reset();
    }
    { MutexLock lock(write_mu_); }  // a write that copied the stream has finished (see Write)
    end.status = stream->Finish();
    MutexLock lock(mu_);
    context_.reset();
    Push(std::move(end));
    if (!reconnect_) return;
    // The next attempt only once the consumer has drained this end: a
    // worker whose step loop is stuck (a rank stopped, a collective that
    // never returns) must not register again and be routed requests it
    // cannot serve; the coordinator dropped it as stalled.
    lock.Wait(changed_, [this]() MLARUN_REQUIRES(mu_) { return stopping_ || leaving_ || inbox_.empty(); });
    lock.WaitFor(changed_, backoff, [this]() MLARUN_REQUIRES(mu_) { return stopping_ || leaving_; });
    backoff = std::min(backoff * 2, kMaxBackoff);
  }
}

}  // namespace mlarun
