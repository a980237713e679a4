#include "cli/commands.hpp"

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <vector>

#include "teo/files.hpp"

extern char** environ;

namespace teo::cli {

namespace {

// A gnuplot single-quoted string: a quote inside is written twice, nothing else is special.
std::string quoted(const std::string& s) {
  std::string out = "'";
  for (char c : s) {
    out += c;
    if (c == '\'') out += '\'';
  }
  return out + "'";
}

// Runs `argv` without a shell, its output discarded; true when it exits 0.
bool run_quietly(std::vector<std::string> args) {
  std::vector<char*> argv;
  argv.reserve(args.size() + 1);
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, "/dev/null", O_WRONLY, 0);
  posix_spawn_file_actions_addopen(&actions, STDERR_FILENO, "/dev/null", O_WRONLY, 0);
  pid_t pid = 0;
  const int rc = posix_spawnp(&pid, argv[0], &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) return false;
  int status = 0;
  while (waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) return false;
  }
  return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

}  // namespace

bool plot_curves(const std::string& csv, const std::string& png) {
  namespace fs = std::filesystem;
  const std::string tmp = png + ".tmp.png";
  const std::string script_path = png + ".gp";
  const std::string data = quoted(csv);
  const std::string series_loss =
      " using (strcol(1) eq 'train' ? $3 : NaN):4 with lines title 'train', "
      "'' using (strcol(1) eq 'valid' ? $3 : NaN):4 with linespoints title 'validation'\n";
  const std::string series_acc =
      " using (strcol(1) eq 'train' ? $3 : NaN):5 with lines title 'train', "
      "'' using (strcol(1) eq 'valid' ? $3 : NaN):5 with linespoints title 'validation'\n";
  write_file_atomic(script_path,
                    "set terminal png size 1100,420\nset output " + quoted(tmp) +
                        "\nset datafile separator ','\nset key autotitle columnhead\n"
                        "set multiplot layout 1,2\nset title 'loss'\nset xlabel 'step'\n"
                        "set grid\nplot " +
                        data + series_loss + "set title 'accuracy'\nset yrange [0:1]\nplot " +
                        data + series_acc + "unset multiplot\n",
                    true);
  const bool ok = run_quietly({"gnuplot", script_path});
  std::error_code ec;
  fs::remove(script_path, ec);
  if (!ok) {
    fs::remove(tmp, ec);
    return false;
  }
  fs::rename(tmp, png, ec);
  return !ec;
}

}  // namespace teo::cli
