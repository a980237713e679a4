// The house's layers: the folders of src/ (and their public headers) stack from the core data (the
// formats' bit definitions among them) through the kernels (their array forms, the products) up to
// the two faces, and no file includes a header of a layer above its own. A back edge fails here,
// naming the file and the include. No library source file is over 800 lines.
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "test_paths.hpp"

namespace {

namespace fs = std::filesystem;
const fs::path kRoot = fs::path(TEO_SOURCE_DIR);

// The layers, lowest first. A file may include its own layer's headers and those below.
enum Layer { core, kernels, layers, model, golden, train, cli, python };
const char* kNames[] = {"core", "kernels", "layers", "model", "golden", "train", "cli", "python"};

// The layer of a path relative to src/, or of a public header relative to include/teo/.
int layer_of_source(const std::string& rel) {
  static const std::vector<std::pair<std::string, Layer>> dirs = {
      {"core/", core},     {"kernels/", kernels}, {"layers/", layers}, {"model/", model},
      {"golden/", golden}, {"train/", train},     {"cli/", cli},       {"python/", python}};
  for (const auto& [dir, l] : dirs)
    if (rel.starts_with(dir)) return l;
  return -1;
}

int layer_of_public(const std::string& rel) {
  static const std::map<std::string, Layer> headers = {
      {"types.hpp", core},         {"errors.hpp", core},         {"tensor.hpp", core},
      {"config.hpp", core},        {"precision.hpp", core},      {"fp8.hpp", core},
      {"safetensors.hpp", core},   {"files.hpp", core},          {"sha256.hpp", core},
      {"suggest.hpp", core},       {"profile.hpp", core},        {"rng.hpp", core},
      {"backend.hpp", kernels},    {"kernels.hpp", kernels},     {"rounding.hpp", kernels},
      {"dequant.hpp", kernels},    {"quant.hpp", core},          {"gguf.hpp", core},
      {"quant_formats.hpp", core}, {"weight_format.hpp", core},  {"model.hpp", model},
      {"contract.hpp", model},     {"bench.hpp", model},         {"generate.hpp", model},
      {"golden.hpp", golden},      {"golden_ops.hpp", golden},   {"names.hpp", golden},
      {"train.hpp", train},        {"decoder_layer.hpp", model}, {"moe_kinds.hpp", core}};
  if (rel.starts_with("layers/")) return layers;
  if (rel.starts_with("train/")) return train;
  const auto it = headers.find(rel);
  return it == headers.end() ? -1 : it->second;
}

struct Edge {
  std::string file, include;
  int from, to;
};

std::vector<Edge> edges() {
  std::vector<Edge> out;
  const std::regex inc(R"re(^\s*#\s*include\s+"([^"]+)")re");
  for (const char* top : {"src", "include/teo"}) {
    for (const auto& e : fs::recursive_directory_iterator(kRoot / top)) {
      const auto ext = e.path().extension();
      if (!e.is_regular_file() || (ext != ".cpp" && ext != ".hpp")) continue;
      const std::string rel = fs::relative(e.path(), kRoot / top).generic_string();
      const int from = std::string(top) == "src" ? layer_of_source(rel) : layer_of_public(rel);
      std::ifstream in(e.path());
      for (std::string line; std::getline(in, line);) {
        std::smatch m;
        if (!std::regex_search(line, m, inc)) continue;
        const std::string target = m[1];
        int to;
        if (target.starts_with("teo/")) {
          to = layer_of_public(target.substr(4));
        } else if (target.find('/') != std::string::npos && layer_of_source(target) >= 0) {
          to = layer_of_source(target);  // "kernels/parallel.hpp", "model/model_internal.hpp"
        } else {
          to = from;  // beside the file: its own folder
        }
        out.push_back({(fs::path(top) / rel).generic_string(), target, from, to});
      }
    }
  }
  return out;
}

TEST(Layering, EveryFileAndHeaderHasALayer) {
  for (const auto& e : edges()) {
    EXPECT_GE(e.from, 0) << e.file << " is in no layer";
    EXPECT_GE(e.to, 0) << e.file << " includes " << e.include << ", which is in no layer";
  }
}

TEST(Layering, NoFileIncludesALayerAboveItsOwn) {
  const auto all = edges();
  ASSERT_GT(all.size(), 200u);
  for (const auto& e : all) {
    if (e.from < 0 || e.to < 0) continue;
    const bool faces = (e.from == cli && e.to == python) || (e.from == python && e.to == cli);
    EXPECT_TRUE(e.to <= e.from && !faces) << e.file << " (" << kNames[e.from] << ") includes "
                                          << e.include << " (" << kNames[e.to] << ")";
  }
}

TEST(Layering, NoLibrarySourceIsOver800Lines) {
  for (const auto& e : fs::recursive_directory_iterator(kRoot / "src")) {
    const auto ext = e.path().extension();
    if (!e.is_regular_file() || (ext != ".cpp" && ext != ".hpp")) continue;
    std::ifstream in(e.path());
    int lines = 0;
    for (std::string line; std::getline(in, line);) ++lines;
    EXPECT_LE(lines, 800) << e.path();
  }
}

}  // namespace
