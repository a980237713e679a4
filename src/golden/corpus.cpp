// Writing a corpus directory (model cases and op cases alike): the file names of cases.json, the
// refusal to overwrite, and the manifest (golden_internal.hpp).
#include <filesystem>

#include "golden_internal.hpp"
#include "teo/files.hpp"
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

void write_corpus(const std::string& dir, const std::vector<std::string>& names, std::ostream& log,
                  const std::function<std::pair<std::string, std::string>(std::size_t)>& make) {
  namespace fs = std::filesystem;
  nlohmann::ordered_json files = nlohmann::ordered_json::array();
  std::uint64_t total = 0;
  for (std::size_t i = 0; i < names.size(); ++i) {
    const auto [bytes, description] = make(i);
    const std::string file = names[i] + ".safetensors";
    write_file_atomic((fs::path(dir) / file).string(), bytes, /*overwrite=*/true);
    nlohmann::ordered_json m;
    m["file"] = file;
    m["sha256"] = sha256_hex(bytes);
    m["bytes"] = bytes.size();
    m["description"] = description;
    files.push_back(std::move(m));
    total += bytes.size();
    log << file << "  " << bytes.size() << " bytes\n";
  }
  nlohmann::ordered_json manifest;
  manifest["format"] = "teo-golden-manifest/1";
  manifest["teo_version"] = TEO_VERSION;
  manifest["total_bytes"] = total;
  manifest["files"] = std::move(files);
  write_file_atomic((fs::path(dir) / "manifest.json").string(), manifest.dump(2) + "\n",
                    /*overwrite=*/true);
  log << names.size() << " cases, " << total << " bytes\n";
}

}  // namespace teo::golden::detail
