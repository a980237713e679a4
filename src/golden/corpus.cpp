// Writing a corpus directory (model cases and op cases alike): the file names of cases.json, the
// refusal to overwrite, and the manifest (golden_internal.hpp).
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <utility>

#include <unistd.h>

#include "golden_internal.hpp"
#include "teo/files.hpp"
#include "teo/golden_ops.hpp"
#include "teo/sha256.hpp"

namespace teo::golden::detail {

std::string corpus_entry_name(const nlohmann::json& entry, const std::string& path) {
  if (!entry.is_object() || !entry.contains("name") || !entry["name"].is_string()) {
    throw ConfigError(path + ": every case needs a \"name\" string");
  }
  auto name = entry["name"].get<std::string>();
  if (name.empty() || name.find_first_of("/\\") != std::string::npos || name[0] == '.') {
    throw ConfigError(path + ": case name \"" + name + "\" is not a plain file name");
  }
  return name;
}

std::string corpus_entry_description(nlohmann::json& entry, const std::string& path,
                                     const std::string& name) {
  if (!entry.contains("description")) return "";
  if (!entry["description"].is_string()) {
    throw ConfigError(path + ": case " + name + ": description must be a string");
  }
  auto d = entry["description"].get<std::string>();
  entry.erase("description");
  return d;
}

void refuse_existing(const std::string& dir, const std::vector<std::string>& names) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path manifest = fs::path(dir) / "manifest.json";
  if (fs::exists(manifest, ec)) {
    throw FileError(manifest.string() + ": already exists (pass --force to regenerate the corpus)");
  }
  for (const auto& n : names) {
    const fs::path f = fs::path(dir) / (n + ".safetensors");
    if (fs::exists(f, ec)) {
      throw FileError(f.string() + ": already exists (pass --force to regenerate the corpus)");
    }
  }
}

CorpusWriter::~CorpusWriter() {
  for (const auto& f : files_) {
    if (f.fd < 0) continue;
    ::close(f.fd);
    ::unlink(f.tmp.c_str());
  }
}

void CorpusWriter::stage(
    const std::string& dir, const std::vector<std::string>& names, std::ostream& log,
    const std::function<std::pair<std::string, std::string>(std::size_t)>& make) {
  namespace fs = std::filesystem;
  Dir d{dir, nlohmann::ordered_json::array(), 0};
  for (std::size_t i = 0; i < names.size(); ++i) {
    const auto [bytes, description] = make(i);
    const std::string file = names[i] + ".safetensors";
    const std::string path = (fs::path(dir) / file).string();
    auto [fd, tmp] = open_temp_beside(path, /*overwrite=*/true);
    files_.push_back({fd, tmp, path});
    if (!write_all_at(fd, bytes.data(), bytes.size(), 0)) {
      throw FileError(path + ": cannot write the temporary file: " + std::strerror(errno));
    }
    nlohmann::ordered_json m;
    m["file"] = file;
    m["sha256"] = sha256_hex(bytes);
    m["bytes"] = bytes.size();
    m["description"] = description;
    d.files.push_back(std::move(m));
    d.total += bytes.size();
    log << file << "  " << bytes.size() << " bytes\n";
  }
  dirs_.push_back(std::move(d));
}

void CorpusWriter::commit(std::ostream& log) {
  namespace fs = std::filesystem;
  for (auto& f : files_) {
    const int fd = std::exchange(f.fd, -1);  // commit_temp closes it, or removes the file
    commit_temp(fd, f.tmp, f.path, /*overwrite=*/true);
  }
  for (auto& d : dirs_) {
    nlohmann::ordered_json manifest;
    manifest["format"] = "teo-golden-manifest/1";
    manifest["teo_version"] = TEO_VERSION;
    manifest["total_bytes"] = d.total;
    const std::size_t cases = d.files.size();
    manifest["files"] = std::move(d.files);
    write_file_atomic((fs::path(d.dir) / "manifest.json").string(), manifest.dump(2) + "\n",
                      /*overwrite=*/true);
    log << d.dir << ": " << cases << " cases, " << d.total << " bytes\n";
  }
  files_.clear();
  dirs_.clear();
}

void stage_op_corpus(const std::string& dir, std::ostream& log, CorpusWriter& writer) {
  namespace fs = std::filesystem;
  const auto entries = read_op_corpus_cases((fs::path(dir) / "cases.json").string());
  writer.stage(dir, names_of(entries), log, [&](std::size_t i) {
    return std::pair{safetensors::serialize(make_op(entries[i].spec)), entries[i].description};
  });
}
}  // namespace teo::golden::detail

namespace teo::golden {

void generate_op_corpus(const std::string& dir, std::ostream& log, bool overwrite) {
  namespace fs = std::filesystem;
  if (!overwrite) {
    detail::refuse_existing(
        dir, detail::names_of(read_op_corpus_cases((fs::path(dir) / "cases.json").string())));
  }
  detail::CorpusWriter writer;
  detail::stage_op_corpus(dir, log, writer);
  writer.commit(log);
}

}  // namespace teo::golden
