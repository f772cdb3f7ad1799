// The launch files in deploy/ (and the commands in docs/multi-node.md)
// against the code they drive. Each file is parsed (YAML with yaml-cpp, shell
// and Markdown by a small shell tokenizer) and checked against what the
// built `mlarun` and this machine's Open MPI say about themselves:
//  * every `mlarun <cmd> --flag` used appears in `mlarun <cmd> --help`, and
//    every routing policy named is one the coordinator lists;
//  * the coordinator's port is the same everywhere it is written down, and
//    is `mlarun coordinator`'s default;
//  * the Kubernetes containers use one image, the tag deploy/README.md
//    builds; the MPIJob's slots, `mpirun -np` and layout agree, and
//    `mlarun memory` accepts the layout for the model the image holds;
//  * the Dockerfiles build with scripts/install-deps and scripts/build and
//    copy the binary from where scripts/build puts it; the runtime image
//    installs the package of every shared library the built binary links;
//  * every MCA parameter and mpirun option exists in this Open MPI;
//  * the Slurm script passes `bash -n` and has both launchers.
// MLARUN_SOURCE_DIR and MLARUN_BINARY come from tests/CMakeLists.txt.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;

const std::string kSource = MLARUN_SOURCE_DIR;
const std::string kMlarun = MLARUN_BINARY;

std::string ReadFile(const std::string& rel) {
  std::ifstream f(kSource + "/" + rel);
  if (!f) {
    ADD_FAILURE() << "cannot read " << rel;
    return "";
  }
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

struct Output {
  int status = -1;   // exit code; -1 when it did not exit normally
  std::string text;  // stdout and stderr together
};

// Runs `command` with sh and waits for it.
Output Shell(const std::string& command) {
  Output out;
  FILE* p = popen((command + " 2>&1").c_str(), "r");
  if (p == nullptr) return out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.text.append(buf, n);
  const int st = pclose(p);
  out.status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return out;
}

bool Have(const std::string& program) { return Shell("command -v " + program + " >/dev/null").status == 0; }

std::vector<std::string> Split(const std::string& s, char sep) {
  std::vector<std::string> parts;
  std::string part;
  std::istringstream in(s);
  while (std::getline(in, part, sep)) parts.push_back(part);
  return parts;
}

// ---- `mlarun ... --help` ---------------------------------------------------

struct Help {
  std::set<std::string> flags;        // "--listen", "--help", ...
  std::set<std::string> subcommands;  // "coordinator", ...
  std::string text;
};

Help ParseHelp(const std::string& text) {
  Help h;
  h.text = text;
  bool subcommands = false;
  std::istringstream in(text);
  std::string line;
  static const std::regex kSub(R"(^\s+([a-z][a-z0-9-]*)\s)");
  static const std::regex kOption(R"(^\s+-)");
  while (std::getline(in, line)) {
    if (line == "Subcommands:") {
      subcommands = true;
    } else if (line == "Options:") {
      subcommands = false;
    } else if (subcommands) {
      std::smatch m;
      if (std::regex_search(line, m, kSub)) h.subcommands.insert(m[1]);
    } else if (std::regex_search(line, kOption)) {
      // "  -h,--help", "  --listen TEXT=...", "  --hbm-gib,--memory-gib FLOAT=141"
      std::string names = line.substr(line.find('-'));
      names = names.substr(0, names.find(' '));
      for (const std::string& name : Split(names, ','))
        if (name.rfind("--", 0) == 0) h.flags.insert(name);
    }
  }
  return h;
}

// The help of `mlarun PATH` ("" for the top level, "coordinator", "bench decode").
const Help& HelpOf(const std::string& path) {
  static std::map<std::string, Help> cache;
  auto it = cache.find(path);
  if (it == cache.end()) {
    const Output out = Shell("'" + kMlarun + "' " + path + " --help");
    EXPECT_EQ(out.status, 0) << "mlarun " << path << " --help: " << out.text;
    it = cache.emplace(path, ParseHelp(out.text)).first;
  }
  return it->second;
}

// ---- shell words ------------------------------------------------------------

struct Word {
  std::string text;
  bool op = false;  // an operator or a redirection: ends a simple command
};
using Command = std::vector<Word>;

// Simple commands of shell `text`: continuation lines joined, quotes removed
// (a quoted string is one word, its $expansions kept as written; a quote
// that does not close on its line is a plain character, as in prose),
// comments dropped; split at newlines and at | & ; ( ) ` and $( (so a
// command substitution is a command of its own); redirections are operators.
std::vector<Command> ShellCommands(const std::string& text) {
  std::vector<Command> commands(1);
  std::string word;
  bool in_word = false;
  auto end_word = [&] {
    if (in_word) commands.back().push_back({word, false});
    word.clear();
    in_word = false;
  };
  auto end_command = [&] {
    end_word();
    if (!commands.back().empty()) commands.emplace_back();
  };
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (c == '\\' && i + 1 < text.size()) {
      if (text[i + 1] != '\n') {
        word += text[i + 1];
        in_word = true;
      }
      ++i;
    } else if ((c == '\'' || c == '"') && text.find(c, i + 1) < text.find('\n', i)) {
      const size_t close = text.find(c, i + 1);
      word += text.substr(i + 1, close - i - 1);
      in_word = true;
      i = close;
    } else if (c == '#' && !in_word) {
      while (i + 1 < text.size() && text[i + 1] != '\n') ++i;
    } else if (c == ' ' || c == '\t') {
      end_word();
    } else if (c == '\n' || c == '|' || c == '&' || c == ';' || c == '(' || c == ')' || c == '`') {
      if (c == '(' && in_word && word.back() == '$') word.pop_back();
      end_command();
    } else if (c == '<' || c == '>') {
      // [n]>target, >>target, <target: one operator word, then the command goes on.
      const bool fd = in_word && std::all_of(word.begin(), word.end(), ::isdigit);
      if (!fd) end_word();
      std::string op(1, c);
      while (i + 1 < text.size() && (text[i + 1] == '>' || text[i + 1] == '&')) op += text[++i];
      while (i + 1 < text.size() && text[i + 1] == ' ') ++i;
      while (i + 1 < text.size() && !std::isspace(static_cast<unsigned char>(text[i + 1]))) op += text[++i];
      word.clear();
      in_word = false;
      commands.back().push_back({op, true});
    } else {
      word += c;
      in_word = true;
    }
  }
  end_command();
  return commands;
}

// The text of the comment lines of a file (a '#' first on the line).
std::string CommentText(const std::string& text) {
  std::string out;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    const size_t first = line.find_first_not_of(" \t");
    if (first != std::string::npos && line[first] == '#') out += line.substr(first + 1) + "\n";
  }
  return out;
}

// The shell of a Markdown file: its sh/bash/untyped fenced blocks, and each
// inline code span as one line.
std::string MarkdownShell(const std::string& md) {
  std::string out, prose;
  std::istringstream in(md);
  std::string line;
  bool fence = false, shell = false;
  while (std::getline(in, line)) {
    const size_t first = line.find_first_not_of(" ");
    const std::string t = first == std::string::npos ? "" : line.substr(first);
    if (t.rfind("```", 0) == 0) {
      if (!fence) {
        const std::string lang = t.substr(3);
        shell = lang.empty() || lang == "sh" || lang == "bash";
      }
      fence = !fence;
      continue;
    }
    if (fence) {
      if (shell) out += line + "\n";
    } else {
      prose += line + "\n";
    }
  }
  static const std::regex kSpan("`([^`]+)`");
  for (std::sregex_iterator it(prose.begin(), prose.end(), kSpan), end; it != end; ++it) {
    std::string span = (*it)[1];
    std::replace(span.begin(), span.end(), '\n', ' ');
    out += span + "\n";
  }
  return out;
}

// A YAML sequence of strings (a container's command + args) as one command.
Command YamlCommand(const YAML::Node& container) {
  Command c;
  for (const char* key : {"command", "args"})
    if (container[key])
      for (const auto& w : container[key]) c.push_back({w.as<std::string>(), false});
  return c;
}

bool IsProgram(const std::string& word, const std::string& program) {
  std::string w = word;
  w.erase(std::remove_if(w.begin(), w.end(), [](char c) { return c == '$' || c == '{' || c == '}'; }), w.end());
  const size_t slash = w.find_last_of('/');
  if (slash != std::string::npos) w = w.substr(slash + 1);
  std::transform(w.begin(), w.end(), w.begin(), ::tolower);
  return w == program;
}

// One `mlarun <path> args...` found in a file.
struct Invocation {
  std::string where;
  std::string path;  // "worker", "bench decode"
  std::vector<std::string> args;
};

std::vector<Invocation> Invocations(const std::vector<Command>& commands, const std::string& where) {
  std::vector<Invocation> found;
  const Help& top = HelpOf("");
  for (const Command& c : commands) {
    for (size_t i = 0; i + 1 < c.size(); ++i) {
      if (c[i].op || !IsProgram(c[i].text, "mlarun") || !top.subcommands.count(c[i + 1].text)) continue;
      Invocation inv{where, c[i + 1].text, {}};
      size_t j = i + 2;
      if (j < c.size() && !c[j].op && HelpOf(inv.path).subcommands.count(c[j].text)) inv.path += " " + c[j++].text;
      for (; j < c.size() && !c[j].op; ++j) inv.args.push_back(c[j].text);
      found.push_back(inv);
    }
  }
  return found;
}

// The value after `flag` (or in `flag=value`); "" when absent.
std::string FlagValue(const std::vector<std::string>& args, const std::string& flag) {
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == flag && i + 1 < args.size()) return args[i + 1];
    if (args[i].rfind(flag + "=", 0) == 0) return args[i].substr(flag.size() + 1);
  }
  return "";
}

int PortOf(const std::string& host_port) {
  const size_t colon = host_port.rfind(':');
  return colon == std::string::npos ? -1 : std::atoi(host_port.c_str() + colon + 1);
}

// ---- the files ----------------------------------------------------------------

const char* const kSbatch = "deploy/slurm/mlarun.sbatch";
const char* const kCoordinatorYaml = "deploy/k8s/coordinator.yaml";
const char* const kMpiJobYaml = "deploy/k8s/mpijob.yaml";
const char* const kDockerfiles[] = {"deploy/docker/Dockerfile", "deploy/docker/Dockerfile.cuda"};
const char* const kMarkdown[] = {"deploy/README.md", "docs/multi-node.md"};

// The shell commands each file holds (YAML: every container's command, and
// the probes' exec commands; every file's comments too).
std::map<std::string, std::vector<Command>> AllCommands() {
  std::map<std::string, std::vector<Command>> all;
  const std::string sbatch = ReadFile(kSbatch);
  all[kSbatch] = ShellCommands(sbatch);
  for (const Command& c : ShellCommands(CommentText(sbatch))) all[kSbatch].push_back(c);
  for (const char* yaml : {kCoordinatorYaml, kMpiJobYaml}) {
    std::vector<Command>& cs = all[yaml];
    for (const YAML::Node& doc : YAML::LoadAllFromFile(kSource + "/" + yaml)) {
      std::vector<YAML::Node> pending{doc};
      while (!pending.empty()) {
        const YAML::Node n = pending.back();
        pending.pop_back();
        if (n.IsMap()) {
          if (n["command"] || n["args"]) cs.push_back(YamlCommand(n));
          for (const auto& kv : n) pending.push_back(kv.second);
        } else if (n.IsSequence()) {
          for (const auto& item : n) pending.push_back(item);
        }
      }
    }
    for (const Command& c : ShellCommands(CommentText(ReadFile(yaml)))) cs.push_back(c);
  }
  for (const char* dockerfile : kDockerfiles) {
    const std::string text = ReadFile(dockerfile);
    all[dockerfile] = ShellCommands(CommentText(text));
    // CMD ["mlarun", "--help"] and the RUN lines.
    for (const Command& c : ShellCommands(std::regex_replace(text, std::regex(R"([\[\],"])"), " ")))
      all[dockerfile].push_back(c);
  }
  for (const char* md : kMarkdown) all[md] = ShellCommands(MarkdownShell(ReadFile(md)));
  return all;
}

std::set<std::string> PathsIn(const std::vector<Invocation>& invs) {
  std::set<std::string> paths;
  for (const Invocation& inv : invs) paths.insert(inv.path);
  return paths;
}

// The routing policies `mlarun coordinator --help` lists ("a | b | c" on the
// line after --policy).
std::set<std::string> Policies() {
  std::istringstream in(HelpOf("coordinator").text);
  std::set<std::string> names;
  for (std::string line; std::getline(in, line);) {
    if (line.find("--policy") == std::string::npos) continue;
    std::getline(in, line);
    for (std::string name : Split(line, '|')) {
      name.erase(0, name.find_first_not_of(' '));
      name.erase(name.find_last_not_of(' ') + 1);
      names.insert(name);
    }
    break;
  }
  EXPECT_GE(names.size(), 2u) << HelpOf("coordinator").text;
  return names;
}

TEST(DeployFiles, MlarunFlagsAreInHelp) {
  const std::map<std::string, std::set<std::string>> expected = {
      {kSbatch, {"coordinator", "worker", "stats", "submit"}},
      {kCoordinatorYaml, {"coordinator", "stats", "submit"}},
      {kMpiJobYaml, {"worker"}},
      {"deploy/docker/Dockerfile", {"generate"}},
      {"deploy/README.md", {"submit", "stats"}},
      {"docs/multi-node.md", {"coordinator", "worker", "stats", "submit", "generate"}},
  };
  const std::set<std::string> policies = Policies();
  int checked = 0;
  for (const auto& [file, commands] : AllCommands()) {
    const std::vector<Invocation> invs = Invocations(commands, file);
    if (auto e = expected.find(file); e != expected.end()) {
      const std::set<std::string> got = PathsIn(invs);
      for (const std::string& path : e->second)
        EXPECT_TRUE(got.count(path)) << file << ": no `mlarun " << path << "` found (the parser missed it?)";
    }
    for (const Invocation& inv : invs) {
      const Help& help = HelpOf(inv.path);
      for (const std::string& arg : inv.args) {
        if (arg.rfind("--", 0) != 0) continue;
        const std::string flag = arg.substr(0, arg.find('='));
        EXPECT_TRUE(help.flags.count(flag))
            << inv.where << ": `mlarun " << inv.path << " " << flag << "` is not in `mlarun " << inv.path << " --help`";
        ++checked;
      }
      const std::string policy = FlagValue(inv.args, "--policy");
      if (!policy.empty() && policy[0] != '$') {
        EXPECT_TRUE(policies.count(policy)) << inv.where << ": unknown policy " << policy;
      }
    }
  }
  EXPECT_GT(checked, 40) << "too few flags found: the parser is broken";
  // The Slurm script's default policy.
  std::smatch m;
  const std::string sbatch = ReadFile(kSbatch);
  ASSERT_TRUE(std::regex_search(sbatch, m, std::regex(R"(MLARUN_POLICY:-([a-z_]+))")));
  EXPECT_TRUE(policies.count(m[1].str())) << "default MLARUN_POLICY " << m[1];
}

// ---- Kubernetes -----------------------------------------------------------------

struct Kube {
  YAML::Node deployment, service, mpijob;
};

Kube LoadKube() {
  Kube k;
  for (const YAML::Node& doc : YAML::LoadAllFromFile(kSource + "/" + kCoordinatorYaml)) {
    const std::string kind = doc["kind"].as<std::string>();
    if (kind == "Deployment") k.deployment = doc;
    if (kind == "Service") k.service = doc;
  }
  k.mpijob = YAML::LoadFile(kSource + "/" + kMpiJobYaml);
  return k;
}

YAML::Node OnlyContainer(const YAML::Node& pod_template, const std::string& what) {
  const YAML::Node containers = pod_template["spec"]["containers"];
  EXPECT_TRUE(containers && containers.size() == 1) << what << ": expected one container";
  return containers[0];
}

// `$(NAME)` in a container's args, from its env (Kubernetes' expansion).
std::string Expand(std::string s, const YAML::Node& container) {
  if (container["env"])
    for (const auto& e : container["env"]) {
      const std::string ref = "$(" + e["name"].as<std::string>() + ")";
      for (size_t at; (at = s.find(ref)) != std::string::npos;) s.replace(at, ref.size(), e["value"].as<std::string>());
    }
  return s;
}

// The Dockerfile's EXPOSEd ports.
std::set<int> Exposed(const std::string& dockerfile) {
  std::set<int> ports;
  const std::string text = ReadFile(dockerfile);
  static const std::regex kExpose(R"((^|\n)EXPOSE\s+(\d+))");
  for (std::sregex_iterator it(text.begin(), text.end(), kExpose), end; it != end; ++it)
    ports.insert(std::stoi((*it)[2]));
  return ports;
}

int DefaultCoordinatorPort() {
  std::smatch m;
  const std::string& help = HelpOf("coordinator").text;
  EXPECT_TRUE(std::regex_search(help, m, std::regex(R"(--listen TEXT=\S+:(\d+))"))) << help;
  return m.empty() ? -1 : std::stoi(m[1]);
}

TEST(DeployFiles, CoordinatorPortIsTheSameEverywhere) {
  const int port = DefaultCoordinatorPort();
  ASSERT_GT(port, 0);
  const Kube k = LoadKube();
  ASSERT_TRUE(k.deployment && k.service) << kCoordinatorYaml << ": needs a Deployment and a Service";
  const YAML::Node c = OnlyContainer(k.deployment["spec"]["template"], "the coordinator Deployment");
  const Command cmd = YamlCommand(c);
  const std::vector<Invocation> coord = Invocations({cmd}, kCoordinatorYaml);
  ASSERT_EQ(coord.size(), 1u);
  ASSERT_EQ(coord[0].path, "coordinator");
  const std::string listen = FlagValue(coord[0].args, "--listen");
  EXPECT_EQ(PortOf(listen), port) << "--listen " << listen;
  ASSERT_TRUE(c["ports"] && c["ports"].size() == 1);
  const int container_port = c["ports"][0]["containerPort"].as<int>();
  const std::string port_name = c["ports"][0]["name"] ? c["ports"][0]["name"].as<std::string>() : "";
  EXPECT_EQ(container_port, port);
  // Readiness through `mlarun stats` on the same port.
  const std::vector<Invocation> probe = Invocations({YamlCommand(c["readinessProbe"]["exec"])}, kCoordinatorYaml);
  ASSERT_EQ(probe.size(), 1u);
  EXPECT_EQ(probe[0].path, "stats");
  EXPECT_EQ(PortOf(FlagValue(probe[0].args, "--coordinator")), port);
  // The Service: selects the pods, forwards its port to the container's.
  const YAML::Node labels = k.deployment["spec"]["template"]["metadata"]["labels"];
  for (const auto& kv : k.service["spec"]["selector"])
    EXPECT_EQ(labels[kv.first.as<std::string>()].as<std::string>(""), kv.second.as<std::string>())
        << "the Service's selector does not match the coordinator pods";
  for (const auto& kv : k.deployment["spec"]["selector"]["matchLabels"])
    EXPECT_EQ(labels[kv.first.as<std::string>()].as<std::string>(""), kv.second.as<std::string>());
  ASSERT_EQ(k.service["spec"]["ports"].size(), 1u);
  const YAML::Node sp = k.service["spec"]["ports"][0];
  EXPECT_EQ(sp["port"].as<int>(), port);
  const std::string target = sp["targetPort"].as<std::string>();
  EXPECT_TRUE(target == port_name || target == std::to_string(container_port)) << "targetPort " << target;
  // The workers reach it as <Service>:<port>.
  const YAML::Node launcher = OnlyContainer(k.mpijob["spec"]["mpiReplicaSpecs"]["Launcher"]["template"], "Launcher");
  const std::vector<Invocation> worker = Invocations({YamlCommand(launcher)}, kMpiJobYaml);
  ASSERT_EQ(worker.size(), 1u);
  const std::string address = FlagValue(worker[0].args, "--coordinator");
  EXPECT_EQ(address, k.service["metadata"]["name"].as<std::string>() + ":" + std::to_string(port));
  // The images and the Slurm script.
  for (const char* dockerfile : kDockerfiles) EXPECT_EQ(Exposed(dockerfile), std::set<int>{port}) << dockerfile;
  std::smatch m;
  const std::string sbatch = ReadFile(kSbatch);
  ASSERT_TRUE(std::regex_search(sbatch, m, std::regex(R"(MLARUN_PORT:-(\d+))")));
  EXPECT_EQ(std::stoi(m[1]), port) << kSbatch << ": default MLARUN_PORT";
}

TEST(DeployFiles, ImagesAgree) {
  const Kube k = LoadKube();
  std::set<std::string> images;
  images.insert(OnlyContainer(k.deployment["spec"]["template"], "coordinator")["image"].as<std::string>());
  for (const char* role : {"Launcher", "Worker"})
    images.insert(
        OnlyContainer(k.mpijob["spec"]["mpiReplicaSpecs"][role]["template"], role)["image"].as<std::string>());
  ASSERT_EQ(images.size(), 1u) << "the coordinator, Launcher and Worker pods run different images";
  const std::string image = *images.begin();
  const std::string readme = ReadFile("deploy/README.md");
  EXPECT_NE(readme.find("docker build -t " + image + " -f deploy/docker/Dockerfile ."), std::string::npos)
      << "deploy/README.md does not build " << image << " from deploy/docker/Dockerfile";
  // The containers call `mlarun`, `mpirun` and `sshd`: the image has them.
  const std::string dockerfile = ReadFile("deploy/docker/Dockerfile");
  EXPECT_NE(dockerfile.find("/usr/local/bin/mlarun"), std::string::npos) << "mlarun is not on the image's PATH";
  EXPECT_NE(dockerfile.find("openmpi-bin"), std::string::npos);
  const YAML::Node worker = OnlyContainer(k.mpijob["spec"]["mpiReplicaSpecs"]["Worker"]["template"], "Worker");
  EXPECT_EQ(worker["command"][0].as<std::string>(), "/usr/sbin/sshd");
  EXPECT_NE(dockerfile.find("openssh-server"), std::string::npos);
  EXPECT_NE(dockerfile.find("mkdir -p /run/sshd"), std::string::npos) << "sshd needs /run/sshd";
}

TEST(DeployFiles, MpiJobAgreesWithItsLayout) {
  const Kube k = LoadKube();
  const YAML::Node& job = k.mpijob;
  EXPECT_EQ(job["apiVersion"].as<std::string>(), "kubeflow.org/v2beta1");
  EXPECT_EQ(job["kind"].as<std::string>(), "MPIJob");
  const YAML::Node specs = job["spec"]["mpiReplicaSpecs"];
  EXPECT_EQ(specs["Launcher"]["replicas"].as<int>(), 1);
  const int workers = specs["Worker"]["replicas"].as<int>();
  const int slots = job["spec"]["slotsPerWorker"] ? job["spec"]["slotsPerWorker"].as<int>() : 1;
  const YAML::Node launcher = OnlyContainer(specs["Launcher"]["template"], "Launcher");
  Command cmd = YamlCommand(launcher);
  ASSERT_FALSE(cmd.empty());
  EXPECT_TRUE(IsProgram(cmd[0].text, "mpirun"));
  std::vector<std::string> words;
  for (const Word& w : cmd) words.push_back(Expand(w.text, launcher));
  const std::string np = FlagValue(words, "-np");
  ASSERT_FALSE(np.empty()) << "mpirun without -np";
  EXPECT_EQ(std::stoi(np), workers * slots) << "-np is not Worker replicas x slotsPerWorker";
  // The pods run as root (no runAsUser): mpirun must be allowed to.
  EXPECT_FALSE(launcher["securityContext"] && launcher["securityContext"]["runAsUser"]);
  EXPECT_NE(std::find(words.begin(), words.end(), "--allow-run-as-root"), words.end());
  EXPECT_EQ(job["spec"]["sshAuthMountPath"].as<std::string>("/root/.ssh"), "/root/.ssh");

  Command expanded;
  for (const std::string& w : words) expanded.push_back({w, false});
  const std::vector<Invocation> inv = Invocations({expanded}, kMpiJobYaml);
  ASSERT_EQ(inv.size(), 1u);
  ASSERT_EQ(inv[0].path, "worker");
  const std::string layout = FlagValue(inv[0].args, "--parallel");
  const std::string model = FlagValue(inv[0].args, "--model");
  // The model is the one the image copies from configs/.
  const std::string in_image = "/opt/mlarun/configs/";
  ASSERT_EQ(model.rfind(in_image, 0), 0u) << "the MPIJob's model " << model << " is not in the image";
  const std::string rel = "configs/" + model.substr(in_image.size());
  EXPECT_TRUE(fs::exists(kSource + "/" + rel)) << rel;
  for (const char* dockerfile : kDockerfiles)
    EXPECT_NE(ReadFile(dockerfile).find("COPY configs /opt/mlarun/configs"), std::string::npos) << dockerfile;
  // The layout fits the ranks and the model (mlarun memory checks both).
  const Output check = Shell("'" + kMlarun + "' memory --model '" + kSource + "/" + rel + "' --world " + np +
                             " --layouts '" + layout + "'");
  EXPECT_EQ(check.status, 0) << "layout " << layout << " on " << np << " ranks of " << rel << ": " << check.text;
}

// ---- Dockerfiles ------------------------------------------------------------------

TEST(DeployFiles, DockerfilesBuildWithTheProjectScripts) {
  for (const char* name : {"scripts/install-deps", "scripts/build"}) {
    const fs::path p = fs::path(kSource) / name;
    ASSERT_TRUE(fs::exists(p)) << name;
    EXPECT_NE(fs::status(p).permissions() & fs::perms::owner_exec, fs::perms::none) << name << " is not executable";
  }
  // scripts/build TYPE builds into build/<type in lower case>.
  const std::string build_script = ReadFile("scripts/build");
  ASSERT_NE(build_script.find("dir=\"$root/build/$(echo \"$type\" | tr '[:upper:]' '[:lower:]')\""), std::string::npos)
      << "scripts/build no longer builds into build/<type>: update the Dockerfiles and this test";
  for (const char* dockerfile : kDockerfiles) {
    SCOPED_TRACE(dockerfile);
    const std::string text = ReadFile(dockerfile);
    std::smatch m;
    ASSERT_TRUE(std::regex_search(
        text, m, std::regex(R"(WORKDIR (\S+)\nCOPY \. \.\nRUN .*scripts/install-deps && scripts/build (\w+))")));
    const std::string workdir = m[1], type = m[2];
    std::string lower = type;
    std::transform(lower.begin(), lower.end(), lower.begin(), ::tolower);
    EXPECT_NE(text.find("COPY --from=build " + workdir + "/build/" + lower + "/mlarun /usr/local/bin/mlarun"),
              std::string::npos)
        << "the binary is not copied from " << workdir << "/build/" << lower;
    EXPECT_TRUE(
        fs::exists(fs::path(kSource) / "deploy/docker" / (fs::path(dockerfile).filename().string() + ".dockerignore")))
        << "no .dockerignore beside it: the build context would carry build/";
  }
  const std::string cuda = ReadFile("deploy/docker/Dockerfile.cuda");
  ASSERT_NE(cuda.find("-DMLARUN_CUDA=ON"), std::string::npos);
  EXPECT_NE(ReadFile("CMakeLists.txt").find("set(MLARUN_CUDA "), std::string::npos) << "MLARUN_CUDA is no CMake option";
}

// The Debian packages a Dockerfile's runtime stage installs (its last
// `apt-get install`), with ${CUDA_VERSION} from its ARG default.
std::vector<std::string> RuntimePackages(const std::string& dockerfile) {
  std::string text = std::regex_replace(ReadFile(dockerfile), std::regex(R"(\\\n)"), " ");
  std::smatch m;
  if (std::regex_search(text, m, std::regex(R"(ARG CUDA_VERSION=(\S+))")))
    text = std::regex_replace(text, std::regex(R"(\$\{CUDA_VERSION\})"), m[1].str());
  std::vector<std::string> packages;
  static const std::regex kInstall(R"(apt-get install -y --no-install-recommends ([^&\n]+))");
  for (std::sregex_iterator it(text.begin(), text.end(), kInstall), end; it != end; ++it) {
    packages.clear();
    std::istringstream words((*it)[1]);
    for (std::string w; words >> w;) packages.push_back(w);
  }
  return packages;
}

TEST(DeployFiles, RuntimeImageHasEveryLibraryTheBinaryLinks) {
  if (!Have("dpkg") || !Have("apt-cache") || !Have("ldd")) GTEST_SKIP() << "needs dpkg, apt-cache and ldd";
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "a sanitizer build (MLARUN_SANITIZE) links the sanitizer runtimes, which the image does not ship";
#endif
  const Output ldd = Shell("ldd '" + kMlarun + "'");
  ASSERT_EQ(ldd.status, 0) << ldd.text;
  // Each linked library's package (usr-merged paths tried both ways), from
  // one dpkg -S over every candidate path.
  std::vector<std::vector<std::string>> candidates;
  std::string all;
  static const std::regex kLib(R"(=>\s+(\S+))");
  for (std::sregex_iterator it(ldd.text.begin(), ldd.text.end(), kLib), end; it != end; ++it) {
    const std::string path = (*it)[1];
    candidates.push_back({path, "/usr" + path, fs::weakly_canonical(path).string()});
    for (const std::string& p : candidates.back()) all += " '" + p + "'";
  }
  std::map<std::string, std::string> owner;  // path -> package
  std::istringstream owners(Shell("dpkg -S" + all).text);
  for (std::string line; std::getline(owners, line);) {
    const size_t sep = line.find(": ");
    if (sep == std::string::npos || line.rfind("dpkg-query:", 0) == 0) continue;
    owner[line.substr(sep + 2)] = line.substr(0, line.find(':'));
  }
  std::set<std::string> linked;
  for (const auto& paths : candidates)
    for (const std::string& p : paths)
      if (owner.count(p)) {
        linked.insert(owner[p]);
        break;
      }
  ASSERT_FALSE(linked.empty()) << ldd.text;
  for (const char* dockerfile : kDockerfiles) {
    SCOPED_TRACE(dockerfile);
    const std::vector<std::string> packages = RuntimePackages(dockerfile);
    ASSERT_FALSE(packages.empty());
    // NVIDIA's packages (CUDA runtime, NCCL) are not in Debian's lists.
    std::string debian, nvidia;
    for (const std::string& p : packages)
      (p.find("cuda") != std::string::npos || p.find("nccl") != std::string::npos ? nvidia : debian) += " " + p;
    const Output deps = Shell(
        "apt-cache depends --recurse --no-recommends --no-suggests --no-conflicts --no-breaks "
        "--no-replaces --no-enhances" +
        debian);
    ASSERT_EQ(deps.status, 0) << deps.text.substr(0, 2000);
    std::set<std::string> closure;
    std::istringstream lines(deps.text);
    for (std::string line; std::getline(lines, line);)
      if (!line.empty() && line[0] != ' ' && line[0] != '<') closure.insert(line.substr(0, line.find(':')));
    for (const std::string& pkg : linked)
      EXPECT_TRUE(closure.count(pkg)) << "the binary links a library of " << pkg
                                      << ", which the runtime image does not install";
    if (std::string(dockerfile).find("cuda") != std::string::npos) {
      EXPECT_NE(nvidia.find("cuda-cudart-"), std::string::npos) << "no CUDA runtime in the CUDA image";
      EXPECT_NE(nvidia.find("libnccl2"), std::string::npos) << "no NCCL in the CUDA image";
    } else {
      EXPECT_TRUE(nvidia.empty()) << "the CPU image installs" << nvidia;
    }
  }
}

// ---- Open MPI and Slurm -------------------------------------------------------------

TEST(DeployFiles, MpiSettingsExistInThisOpenMpi) {
  if (!Have("ompi_info") || !Have("mpirun")) GTEST_SKIP() << "no Open MPI here";
  const Output info = Shell("ompi_info --all --parsable");
  ASSERT_EQ(info.status, 0);
  std::set<std::string> params;
  static const std::regex kParam(R"(:param:([A-Za-z0-9_]+):value:)");
  for (std::sregex_iterator it(info.text.begin(), info.text.end(), kParam), end; it != end; ++it)
    params.insert((*it)[1]);
  ASSERT_GT(params.size(), 100u);
  const Output help = Shell("OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 mpirun --help all");
  ASSERT_NE(help.text.find("--map-by"), std::string::npos) << help.text.substr(0, 2000);
  int mca = 0, options = 0;
  for (const auto& [file, commands] : AllCommands()) {
    // MCA names after --mca (anywhere: the Slurm script builds them into an array).
    for (const Command& c : commands)
      for (size_t i = 0; i + 1 < c.size(); ++i)
        if (!c[i].op && (c[i].text == "--mca" || c[i].text == "-mca")) {
          EXPECT_TRUE(params.count(c[i + 1].text)) << file << ": no MCA parameter " << c[i + 1].text;
          ++mca;
        }
    // mpirun's own options, up to the program it starts.
    for (const Command& c : commands)
      for (size_t i = 0; i < c.size(); ++i) {
        if (c[i].op || !IsProgram(c[i].text, "mpirun")) continue;
        for (size_t j = i + 1; j < c.size() && !c[j].op && !IsProgram(c[j].text, "mlarun"); ++j) {
          const std::string& w = c[j].text;
          if (w == "--mca" || w == "-mca" || w == "-x") {
            j += w == "-x" ? 1 : 2;
            continue;
          }
          if (w.size() < 2 || w[0] != '-' || w[1] == '$') continue;
          const std::regex listed("(^|[\\s|,])" + w + "([\\s|,]|$)");
          EXPECT_TRUE(std::regex_search(help.text, listed)) << file << ": mpirun has no option " << w;
          ++options;
        }
      }
    // OMPI_MCA_<name>=... spelled out.
    const std::string text = ReadFile(file);
    static const std::regex kEnv(R"(OMPI_MCA_([A-Za-z0-9_]+))");
    for (std::sregex_iterator it(text.begin(), text.end(), kEnv), end; it != end; ++it)
      EXPECT_TRUE(params.count((*it)[1])) << file << ": no MCA parameter " << (*it)[1];
  }
  EXPECT_GT(mca, 15) << "too few --mca settings found: the parser is broken";
  EXPECT_GT(options, 10) << "too few mpirun options found: the parser is broken";
}

TEST(DeployFiles, SlurmScriptParsesAndHasBothLaunchers) {
  const Output syntax = Shell("bash -n '" + kSource + "/" + kSbatch + "'");
  EXPECT_EQ(syntax.status, 0) << syntax.text;
  const std::string text = ReadFile(kSbatch);
  EXPECT_EQ(text.rfind("#!/bin/bash\n#SBATCH ", 0), 0u) << "#SBATCH lines must follow the #! line";
  for (const char* option : {"--nodes=", "--ntasks-per-node=", "--cpus-per-task=", "--time="})
    EXPECT_NE(text.find(std::string("#SBATCH ") + option), std::string::npos) << option;
  bool by_mpirun = false, by_srun = false;
  for (const Command& c : ShellCommands(text)) {
    const std::vector<Invocation> invs = Invocations({c}, kSbatch);
    if (invs.empty() || invs[0].path != "worker") continue;
    if (IsProgram(c[0].text, "mpirun")) by_mpirun = true;
    if (IsProgram(c[0].text, "srun")) {
      by_srun = true;
      EXPECT_TRUE(std::any_of(c.begin(), c.end(), [](const Word& w) { return w.text == "--mpi=pmix"; }));
    }
    EXPECT_EQ(FlagValue(invs[0].args, "--parallel"), "$layout");
    EXPECT_EQ(FlagValue(invs[0].args, "--threads"), "$cpus");
  }
  EXPECT_TRUE(by_mpirun) << "no `mpirun ... mlarun worker`";
  EXPECT_TRUE(by_srun) << "no `srun --mpi=pmix ... mlarun worker`";
}

}  // namespace
