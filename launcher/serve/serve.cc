#include "launcher/serve/serve.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <ostream>
#include <sstream>
#include <thread>

#include "mlarun.grpc.pb.h"
#include "parallel/layout.h"
#include "runtime/model/model_config.h"
#include "serving/client/grpc_util.h"
#include "serving/security/security.h"

extern char** environ;

namespace mlarun {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// How a child ended, in words.
std::string DescribeExit(int wait_status) {
  if (WIFEXITED(wait_status)) return "exited with status " + std::to_string(WEXITSTATUS(wait_status));
  if (WIFSIGNALED(wait_status)) {
    const char* name = sigabbrev_np(WTERMSIG(wait_status));
    return std::string("was killed by SIG") + (name != nullptr ? name : std::to_string(WTERMSIG(wait_status)));
  }
  return "ended (wait status " + std::to_string(wait_status) + ")";
}

// The parent of `pid` as /proc says; nullopt when it is gone.
std::optional<pid_t> ParentOf(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return std::nullopt;
  // pid (comm) state ppid ...: comm may hold spaces and parentheses.
  const size_t close = line.rfind(')');
  if (close == std::string::npos) return std::nullopt;
  std::istringstream rest(line.substr(close + 1));
  char state = 0;
  pid_t ppid = 0;
  if (!(rest >> state >> ppid)) return std::nullopt;
  return ppid;
}

// The pids whose parent is this process (the job's launcher, and any of its
// descendants orphaned to us: this process is their subreaper), zombies
// included: a launcher whose main thread has exited shows as a zombie while
// its other threads, and the ranks they are the parent of, still run; only
// reaping it (once all of them are done) ends it.
std::vector<pid_t> Children() {
  std::vector<pid_t> out;
  const pid_t self = getpid();
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/proc", ec)) {
    const std::string name = entry.path().filename();
    if (name.empty() || name.find_first_not_of("0123456789") != std::string::npos) continue;
    const pid_t pid = std::stoi(name);
    if (ParentOf(pid) == self) out.push_back(pid);
  }
  return out;
}

// The executable `name` names: itself when it holds a '/', else the first
// executable file of that name on PATH; "" when there is none.
std::string FindOnPath(const std::string& name) {
  if (name.find('/') != std::string::npos) return name;
  const char* path = std::getenv("PATH");
  std::istringstream dirs(path != nullptr ? path : "/usr/local/bin:/usr/bin:/bin");
  std::string dir;
  while (std::getline(dirs, dir, ':')) {
    const std::string candidate = (dir.empty() ? "." : dir) + "/" + name;
    std::error_code ec;
    if (access(candidate.c_str(), X_OK) == 0 && !std::filesystem::is_directory(candidate, ec)) return candidate;
  }
  return "";
}

// Whether `pid` names a process that exists (one of another user counts).
bool ProcessExists(pid_t pid) { return kill(pid, 0) == 0 || errno != ESRCH; }

// Open MPI settings that keep a one-machine job on this machine: the ranks
// talk through shared memory (ob1 over vader: no TCP BTL, which would listen
// on every address), and should the user choose TCP, its BTL and the
// launcher's out-of-band channel use loopback only. Open MPI 4.1's launcher
// still binds its out-of-band listener to every address (no setting
// changes that); docs/security.md says so.
struct LoopbackMca {
  const char* name;
  const char* value;
  const char* exclusive;  // a setting that rules this one out when given
};
constexpr LoopbackMca kLoopbackMca[] = {
    {"pml", "ob1", nullptr},
    {"btl", "self,vader", nullptr},
    {"btl_tcp_if_include", "lo", "btl_tcp_if_exclude"},
    {"oob_tcp_if_include", "lo", "oob_tcp_if_exclude"},
};

// Whether the user set the MCA parameter `name`: an `--mca NAME VALUE` among
// the mpirun arguments, or OMPI_MCA_NAME in the environment.
bool McaGiven(const std::vector<std::string>& mpirun_args, const std::string& name) {
  for (size_t i = 0; i + 1 < mpirun_args.size(); ++i) {
    const std::string& a = mpirun_args[i];
    if ((a == "--mca" || a == "-mca" || a == "--gmca" || a == "-gmca") && mpirun_args[i + 1] == name) return true;
  }
  return std::getenv(("OMPI_MCA_" + name).c_str()) != nullptr;
}

// Reaps every ended child without blocking; returns the wait status of
// `job` if it was among them.
std::optional<int> ReapAll(pid_t job) {
  std::optional<int> job_status;
  int status = 0;
  pid_t pid;
  while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
    if (pid == job) job_status = status;
  }
  return job_status;
}

// --model as the job loads it, checked before anything starts: an error
// saying what the path is not (else the coordinator would report only the
// tokenizer it cannot find there).
Status CheckModelPath(const std::string& model) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::file_status st = fs::status(model, ec);
  if (!fs::exists(st)) return NotFoundError(model, ": no such file or directory");
  if (fs::is_directory(st)) {
    if (!fs::is_regular_file(fs::path(model) / "config.json", ec))
      return InvalidArgumentError(model, ": not a checkpoint directory (it has no config.json)");
    return LoadHfConfig(model).status();
  }
  const std::string ext = fs::path(model).extension().string();
  if (ext == ".yaml" || ext == ".yml") return LoadModelYaml(model).status();
  return InvalidArgumentError(model, ": not a model YAML (configs/models/*.yaml) or a checkpoint directory");
}

class Serve {
 public:
  Serve(const ServeOptions& o, std::atomic<bool>* stop, std::ostream& log) : o_(o), stop_(stop), log_(log) {}

  int Run() {
    // A log whose reader left (`mlarun serve ... 2>&1 | head`) fails writes
    // with EPIPE instead of killing serve with its job running and its
    // secret directory left behind. The job gets the default back (ExecJob).
    signal(SIGPIPE, SIG_IGN);
    const int code = Steps();
    if (code != 0) Say("failed: " + (failure_.empty() ? std::string("see the messages above") : failure_));
    return code;
  }

 private:
  int Steps() {
    auto layout = ParseParallelLayout(o_.parallel);
    if (!layout.ok()) return Fail("--parallel: " + std::string(layout.status().message())), 2;
    layout_ = *layout;
    if (!o_.prefill_parallel.empty()) {
      auto prefill = ParseParallelLayout(o_.prefill_parallel);
      if (!prefill.ok()) return Fail("--prefill-parallel: " + std::string(prefill.status().message())), 2;
      prefill_layout_ = *prefill;
      if (WorkerArgGiven("--role"))
        return Fail("--prefill-parallel sets each job's --role: drop --worker-arg=--role"), 2;
    }
    if (o_.model.empty()) return Fail("--model is required"), 2;
    if (Status st = CheckModelPath(o_.model); !st.ok()) return Fail("--model: " + std::string(st.message())), 2;
    if (!o_.coordinator.tls.cert.empty())
      return Fail("TLS is for coordinators reached from other machines: use mlarun coordinator"), 2;
    if (!MakeSecret()) return Cleanup(), 1;
    CoordinatorOptions co = o_.coordinator;
    co.worker_secret = secret_;
    if (!co.http_listen.empty() && co.http_model.empty() && co.http_tokenizer == nullptr) co.http_model = o_.model;
    auto coordinator = Coordinator::Start(co);
    if (!coordinator.ok()) {
      Cleanup();
      Fail("the coordinator did not start: " + coordinator.status().ToString());
      return coordinator.status().code() == StatusCode::kInvalidArgument ? 2 : 1;
    }
    coordinator_ = std::move(*coordinator);
    channel_ = client_internal::MakeChannel(coordinator_->address());
    stub_ = v1::Mlarun::NewStub(channel_);
    // Orphaned ranks (their launcher killed) become our children, so nothing
    // the job started can outlive us unseen.
    prctl(PR_SET_CHILD_SUBREAPER, 1);

    int code = Supervise();
    StopJob();
    coordinator_->Shutdown();
    Cleanup();
    if (code == 0) Say("stopped");
    return code;
  }

  void Say(const std::string& line) { log_ << "mlarun serve: " << line << std::endl; }
  // A fatal problem: the first is serve's last line ("failed: ..."), after
  // whatever the job still prints while it is stopped.
  void Fail(const std::string& cause) {
    if (failure_.empty()) failure_ = cause;
  }

  // The secret's directory, with this process's pid beside the secret so
  // that a later serve can tell a directory whose serve is gone (killed
  // before it could clean up) and remove it.
  bool MakeSecret() {
    RemoveStaleSecretDirs();
    std::string dir_template = TempDir() + "/mlarun-serve-XXXXXX";
    if (mkdtemp(dir_template.data()) == nullptr)
      return Fail("cannot make a temporary directory in " + TempDir() + ": " + strerror(errno)), false;
    dir_ = dir_template;
    secret_ = RandomHex(32);
    secret_path_ = dir_ + "/worker-secret";
    if (!WriteFile(secret_path_, secret_, 0600)) return false;
    return WriteFile(dir_ + "/" + kPidFile, std::to_string(getpid()) + "\n", 0600);
  }

  bool WriteFile(const std::string& path, const std::string& text, mode_t mode) {
    const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, mode);
    if (fd < 0 || write(fd, text.data(), text.size()) != static_cast<ssize_t>(text.size())) {
      if (fd >= 0) close(fd);
      return Fail("cannot write " + path + ": " + strerror(errno)), false;
    }
    close(fd);
    return true;
  }

  // $TMPDIR, else /tmp.
  static std::string TempDir() {
    const char* t = std::getenv("TMPDIR");
    std::error_code ec;
    return t != nullptr && *t != '\0' && std::filesystem::is_directory(t, ec) ? std::string(t) : "/tmp";
  }

  // Removes the $TMPDIR/mlarun-serve-* directories of this user whose serve
  // (the pid in their kPidFile) no longer exists. A directory without a
  // readable pid (one being made right now) or whose pid is alive stays.
  void RemoveStaleSecretDirs() {
    std::error_code ec;
    for (const auto& entry : std::filesystem::directory_iterator(TempDir(), ec)) {
      const std::string name = entry.path().filename();
      if (!name.starts_with("mlarun-serve-")) continue;
      struct stat st;
      if (lstat(entry.path().c_str(), &st) != 0 || !S_ISDIR(st.st_mode) || st.st_uid != geteuid()) continue;
      std::ifstream pid_file(entry.path() / kPidFile);
      long pid = 0;
      if (!(pid_file >> pid) || pid <= 0 || pid > std::numeric_limits<pid_t>::max()) continue;
      if (ProcessExists(static_cast<pid_t>(pid))) continue;
      std::error_code removed;
      std::filesystem::remove_all(entry.path(), removed);
      Say((removed ? "cannot remove " : "removed ") + entry.path().string() + ", left by a serve (pid " +
          std::to_string(pid) + ") that is gone" + (removed ? ": " + removed.message() : ""));
    }
  }

  void Cleanup() {
    if (dir_.empty()) return;
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
    dir_.clear();
  }

  // The binary the ranks run: ours by its resolved path (the ranks' own
  // /proc/self/exe would name mpirun's launch of them, not us).
  std::string SelfExe() const {
    if (!o_.self_exe.empty()) return o_.self_exe;
    std::error_code ec;
    return std::filesystem::read_symlink("/proc/self/exe", ec).string();
  }

  bool Disaggregated() const { return !o_.prefill_parallel.empty(); }
  // Whether a --worker-arg names `flag` (as `flag VALUE` or `flag=VALUE`).
  bool WorkerArgGiven(const std::string& flag) const {
    return std::any_of(o_.worker_args.begin(), o_.worker_args.end(),
                       [&](const std::string& a) { return a == flag || a.starts_with(flag + "="); });
  }
  // Every rank and every DP group of the job (both of its worker jobs).
  int Ranks() const { return layout_.world() + (Disaggregated() ? prefill_layout_.world() : 0); }
  int Groups() const { return layout_.dp + (Disaggregated() ? prefill_layout_.dp : 0); }
  std::string Describe() const {
    return Disaggregated() ? "prefill " + o_.prefill_parallel + " + decode " + o_.parallel : o_.parallel;
  }

  std::vector<std::string> JobArgv() const {
    std::vector<std::string> argv{o_.mpirun};
    for (const std::string& a : o_.mpirun_args) argv.push_back(a);
    const unsigned cores = std::thread::hardware_concurrency();
    const bool oversubscribe_given =
        std::find(o_.mpirun_args.begin(), o_.mpirun_args.end(), "--oversubscribe") != o_.mpirun_args.end();
    if (!oversubscribe_given && static_cast<unsigned>(Ranks()) > cores) argv.push_back("--oversubscribe");
    for (const LoopbackMca& m : kLoopbackMca) {
      if (!McaGiven(o_.mpirun_args, m.name) && (m.exclusive == nullptr || !McaGiven(o_.mpirun_args, m.exclusive)))
        argv.insert(argv.end(), {"--mca", m.name, m.value});
    }
    if (!Disaggregated()) {
      AppendWorker(argv, layout_, o_.parallel, {});
      return argv;
    }
    // One MPMD launch, each application context a worker job of its own
    // (MpiSession splits the world by context).
    std::vector<std::string> extra;
    if (!WorkerArgGiven("--transfer")) extra = {"--transfer", "any"};
    extra.insert(extra.end(), {"--role", "prefill"});
    AppendWorker(argv, prefill_layout_, o_.prefill_parallel, extra);
    argv.push_back(":");
    extra.back() = "decode";
    AppendWorker(argv, layout_, o_.parallel, extra);
    return argv;
  }
  // `-np N mlarun worker ...` of one layout, then `extra`.
  void AppendWorker(std::vector<std::string>& argv, const ParallelLayout& layout, const std::string& parallel,
                    const std::vector<std::string>& extra) const {
    argv.insert(argv.end(),
                {"-np", std::to_string(layout.world()), SelfExe(), "worker", "--coordinator", coordinator_->address(),
                 "--model", o_.model, "--parallel", parallel, "--worker-secret-file", secret_path_});
    for (const std::string& a : o_.worker_args) argv.push_back(a);
    argv.insert(argv.end(), extra.begin(), extra.end());
  }

  // The job's environment: ours, with the pid the ranks watch
  // (kServePidVariable), the file for their start-up failure
  // (kServeFailureFileVariable) and Open MPI's consent to run as root.
  std::vector<std::string> JobEnvironment() const {
    std::vector<std::string> env;
    const std::string watch_prefix = std::string(kServePidVariable) + "=";
    const std::string failure_prefix = std::string(kServeFailureFileVariable) + "=";
    for (char** e = environ; *e != nullptr; ++e) {
      const std::string_view v(*e);
      if (!v.starts_with(watch_prefix) && !v.starts_with(failure_prefix)) env.emplace_back(*e);
    }
    env.push_back(watch_prefix + std::to_string(getpid()));
    env.push_back(failure_prefix + FailureFile());
    if (geteuid() == 0) {
      // Open MPI refuses root unless told; serve's ranks are our own children.
      for (const char* v : {"OMPI_ALLOW_RUN_AS_ROOT=1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1"}) env.emplace_back(v);
    }
    return env;
  }

  // Starts the worker job in its own process group (a terminal's Ctrl-C
  // reaches only us; we stop the job). The launcher gets SIGTERM when this
  // thread ends (PR_SET_PDEATHSIG), which for the thread that runs RunServe
  // is when serve ends, however it ends: SIGKILL and the OOM killer
  // included; it passes the signal to the ranks, and they watch serve
  // themselves too (WatchServeProcess).
  bool StartJob() {
    std::vector<std::string> args = JobArgv();
    const std::string exe = FindOnPath(o_.mpirun);
    if (exe.empty()) return Fail("cannot start " + o_.mpirun + ": not found on PATH"), false;
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    std::vector<std::string> env_strings = JobEnvironment();
    std::vector<char*> envp;
    for (std::string& e : env_strings) envp.push_back(e.data());
    envp.push_back(nullptr);

    // exec's failure comes back through a close-on-exec pipe.
    int report[2];
    if (pipe2(report, O_CLOEXEC) != 0) return Fail(std::string("cannot make a pipe: ") + strerror(errno)), false;
    const pid_t parent = getpid();
    const pid_t pid = fork();
    if (pid == 0) ExecJob(exe.c_str(), argv.data(), envp.data(), parent, report[1]);  // never returns
    close(report[1]);
    int child_errno = 0;
    const ssize_t got = pid > 0 ? read(report[0], &child_errno, sizeof child_errno) : 0;
    close(report[0]);
    if (pid < 0 || got == sizeof child_errno) {
      if (pid > 0) waitpid(pid, nullptr, 0);
      Fail("cannot start " + o_.mpirun + ": " + strerror(pid < 0 ? errno : child_errno));
      return false;
    }
    job_ = pid;
    job_started_ = Clock::now();
    std::string line;
    for (const std::string& a : args) line += (line.empty() ? "" : " ") + a;
    Say("started the worker job (pid " + std::to_string(pid) + "): " + line);
    return true;
  }

  // The forked child: only async-signal-safe calls until exec.
  [[noreturn]] static void ExecJob(const char* exe, char* const* argv, char* const* envp, pid_t parent, int report) {
    setpgid(0, 0);
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (getppid() != parent) _exit(127);  // serve ended before the line above
    struct sigaction dfl = {};
    dfl.sa_handler = SIG_DFL;
    for (int sig : {SIGINT, SIGTERM, SIGPIPE}) sigaction(sig, &dfl, nullptr);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    execve(exe, argv, envp);
    const int e = errno;
    [[maybe_unused]] ssize_t w = write(report, &e, sizeof e);
    _exit(127);
  }

  // SIGTERM to the job's process group (mpirun passes it to the ranks),
  // SIGKILL to whatever is left after the grace, until no child is left.
  void StopJob() {
    if (job_ > 0) kill(-job_, SIGTERM);
    // Not the launcher twice: mpirun takes a second SIGTERM as "now", and
    // kills the ranks before their leaders can tell the coordinator they
    // are stopping on request.
    for (pid_t p : Children())
      if (p != job_) kill(p, SIGTERM);
    const auto kill_at =
        Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(o_.stop_grace_s));
    bool killed = false;
    for (;;) {
      ReapAll(job_);
      const std::vector<pid_t> left = Children();
      if (left.empty()) break;
      if (!killed && Clock::now() >= kill_at) {
        Say("the worker job did not stop within " + std::to_string(o_.stop_grace_s) + " s: killing it");
        if (job_ > 0) kill(-job_, SIGKILL);
        for (pid_t p : left) kill(p, SIGKILL);
        killed = true;
      } else if (killed) {
        for (pid_t p : left) kill(p, SIGKILL);  // orphans that arrived since
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    job_ = -1;
  }

  // Connected groups as the coordinator's Health says (-1: no answer).
  int GroupsConnected() {
    grpc::ClientContext ctx;
    client_internal::SetDeadline(ctx, 1.0);
    v1::HealthResponse r;
    if (!stub_->Health(&ctx, v1::HealthRequest{}, &r).ok()) return -1;
    return r.groups_connected();
  }

  bool Stopping() const { return stop_->load(); }

  int Supervise() {
    double backoff = o_.restart_backoff_s;
    bool ever_ready = false;
    for (;;) {
      if (Stopping()) return 0;
      if (!StartJob()) return 1;
      bool ready = false;
      auto last_note = Clock::now();
      const auto ready_deadline =
          Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(o_.ready_timeout_s));
      std::optional<int> ended;
      while (!Stopping()) {
        if ((ended = ReapAll(job_))) break;
        if (!ready) {
          const int connected = GroupsConnected();
          if (connected >= Groups()) {
            ready = ever_ready = true;
            Say("ready: " + std::to_string(Groups()) + " DP group(s) of " + Describe() + " registered after " +
                Format(Seconds(Clock::now() - job_started_)) + " s; gRPC client API at " + coordinator_->address() +
                (coordinator_->http_address().empty()
                     ? std::string()
                     : ", OpenAI-compatible HTTP API at http://" + coordinator_->http_address() + "/v1"));
          } else if (Clock::now() >= ready_deadline) {
            Fail("the worker job's groups did not all register within " + Format(o_.ready_timeout_s) + " s (" +
                 std::to_string(std::max(connected, 0)) + " of " + std::to_string(Groups()) + ")");
            return 1;
          } else if (Clock::now() - last_note >= std::chrono::seconds(10)) {
            Say("waiting for the worker job: " + std::to_string(std::max(connected, 0)) + " of " +
                std::to_string(Groups()) + " DP group(s) registered");
            last_note = Clock::now();
          }
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(ready ? 200 : 100));
      }
      if (Stopping()) return 0;
      const double ran = Seconds(Clock::now() - job_started_);
      Say("the worker job (pid " + std::to_string(job_) + ") " + DescribeExit(*ended) + " after " + Format(ran) + " s" +
          (ready ? "" : ", before its groups registered"));
      StopJob();  // what it left behind
      if (!ever_ready) {
        Say("not restarting a job that never became ready: see its messages above");
        failure_ = StartFailure(*ended);
        return 1;
      }
      if (ran >= 60) backoff = o_.restart_backoff_s;
      Say("restarting it in " + Format(backoff) + " s");
      const auto resume =
          Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(backoff));
      while (!Stopping() && Clock::now() < resume) std::this_thread::sleep_for(std::chrono::milliseconds(50));
      backoff = std::min(backoff * 2, o_.restart_backoff_max_s);
    }
  }

  std::string FailureFile() const { return dir_ + "/start-failure"; }

  // Why the job that never became ready ended: what a rank reported
  // (ReportStartFailure), else how the job ended.
  std::string StartFailure(int wait_status) const {
    std::ifstream in(FailureFile());
    std::string cause;
    if (std::getline(in, cause) && !cause.empty()) return cause;
    return "the worker job " + DescribeExit(wait_status) + " before its groups registered (its messages are above)";
  }

  static std::string Format(double s) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.1f", s);
    return buf;
  }

  const ServeOptions& o_;
  std::atomic<bool>* const stop_;
  std::ostream& log_;
  ParallelLayout layout_;
  ParallelLayout prefill_layout_;  // with prefill_parallel
  static constexpr char kPidFile[] = "serve-pid";
  std::string dir_, secret_, secret_path_;
  std::string failure_;  // the first fatal problem, for the last line
  std::unique_ptr<Coordinator> coordinator_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Mlarun::Stub> stub_;
  pid_t job_ = -1;
  Clock::time_point job_started_;
};

}  // namespace

int RunServe(const ServeOptions& o, std::atomic<bool>* stop, std::ostream& log) { return Serve(o, stop, log).Run(); }

namespace {

// Whether `pid` is this process's parent, its parent's parent, and so on.
bool IsAncestor(pid_t pid) {
  pid_t p = getppid();
  for (int hops = 0; p > 1 && hops < 64; ++hops) {
    if (p == pid) return true;
    const std::optional<pid_t> parent = ParentOf(p);
    if (!parent) return false;
    p = *parent;
  }
  return p == pid;
}

}  // namespace

void ReportStartFailure(const std::string& cause) {
  const char* path = std::getenv(kServeFailureFileVariable);
  if (path == nullptr || *path == '\0') return;
  const int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) return;  // another rank said it first, or serve is gone
  std::string line = cause;
  std::replace(line.begin(), line.end(), '\n', ' ');
  line += "\n";
  [[maybe_unused]] const ssize_t w = write(fd, line.data(), line.size());
  close(fd);
}

Status WatchServeProcess() {
  const char* value = std::getenv(kServePidVariable);
  if (value == nullptr || *value == '\0') return Status::Ok();
  char* end = nullptr;
  const long pid = std::strtol(value, &end, 10);
  if (*end != '\0' || pid <= 1 || pid > std::numeric_limits<pid_t>::max())
    return InvalidArgumentError(kServePidVariable, "=", value, ": expected the pid of `mlarun serve`");
  std::thread([serve = static_cast<pid_t>(pid)] {
    while (IsAncestor(serve)) std::this_thread::sleep_for(std::chrono::seconds(1));
    std::fprintf(stderr, "mlarun worker: the serve process (pid %d) that started this job is gone: exiting\n",
                 static_cast<int>(serve));
    _exit(1);
  }).detach();
  return Status::Ok();
}

}  // namespace mlarun
