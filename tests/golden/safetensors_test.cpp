// The safetensors reader and writer: round trips, and every malformation the strict reader must
// name instead of reading past a buffer or accepting a file other readers would misread.
#include <sys/resource.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "support.hpp"
#include "teo/contract.hpp"
#include "teo/files.hpp"
#include "teo/golden.hpp"
#include "teo/safetensors.hpp"
#include "teo/sha256.hpp"

namespace {

using teo::FileError;
using teo::FormatError;
namespace st = teo::safetensors;

std::string u64le(std::uint64_t n) {
  std::string s;
  for (int i = 0; i < 8; ++i) s.push_back(static_cast<char>((n >> (8 * i)) & 0xff));
  return s;
}

// A file from a header text and a data block, with the header length written correctly.
std::string file_of(const std::string& header, const std::string& data) {
  return u64le(header.size()) + header + data;
}

// The FormatError message parse() gives, or "" when it accepts the bytes.
std::string rejection(const std::string& bytes, const st::Limits& limits = {}) {
  try {
    st::parse(bytes, "test.safetensors", limits);
  } catch (const FormatError& e) {
    return e.what();
  }
  return "";
}

st::File sample() {
  st::File f;
  f.metadata = {{"format", "x/1"}, {"note", "two words"}};
  const std::vector<float> a = {1.5f, -2.0f, 0.0f, 3.25f, -0.0f, 1e-30f};
  const std::vector<double> b = {1.0 / 3.0, -1e300};
  const std::vector<std::int64_t> c = {-5, 1LL << 40, 7};
  const std::vector<std::uint8_t> d = {1, 0, 1};
  const std::vector<double> scalar = {42.0};
  f.add<float>("a", {2, 3}, a.data(), a.size());
  f.add<std::uint8_t>("d", {3}, d.data(), d.size());  // breaks 8-byte alignment on purpose
  f.add<double>("b", {2}, b.data(), b.size());
  f.add<std::int64_t>("c", {3, 1}, c.data(), c.size());
  f.add<double>("empty", {0, 4}, nullptr, 0);
  f.add<double>("scalar", {}, scalar.data(), 1);
  return f;
}

TEST(SafeTensors, RoundTripKeepsNamesOrderShapesBytesAndMetadata) {
  const st::File f = sample();
  const std::string bytes = st::serialize(f);
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(bytes[i]);
  EXPECT_EQ(n % 8, 0u) << "the header is padded to a multiple of 8 bytes";
  const st::File g = st::parse(bytes, "mem");
  EXPECT_EQ(g.metadata, f.metadata);
  ASSERT_EQ(g.tensors.size(), f.tensors.size());
  for (std::size_t i = 0; i < f.tensors.size(); ++i) {
    EXPECT_EQ(g.tensors[i].name, f.tensors[i].name);
    EXPECT_EQ(g.tensors[i].dtype, f.tensors[i].dtype);
    EXPECT_EQ(g.tensors[i].shape, f.tensors[i].shape);
    EXPECT_EQ(g.tensors[i].bytes, f.tensors[i].bytes);
  }
  EXPECT_EQ(g.find("b")->values<double>()[1], -1e300);
  EXPECT_EQ(g.find("c")->values<std::int64_t>()[1], 1LL << 40);
  EXPECT_EQ(g.find("scalar")->numel(), 1);
  EXPECT_EQ(g.find("empty")->numel(), 0);
  EXPECT_EQ(*g.meta("note"), "two words");
  EXPECT_EQ(st::serialize(g), bytes) << "serialising what was read gives the same bytes";
  EXPECT_THROW(g.find("a")->values<double>(), FormatError);
}

TEST(SafeTensors, AddRejectsDuplicatesAndSizeMismatches) {
  st::File f;
  const std::vector<float> v(4);
  f.add<float>("x", {4}, v.data(), 4);
  EXPECT_THROW(f.add<float>("x", {4}, v.data(), 4), FormatError);
  EXPECT_THROW(f.add<float>("y", {5}, v.data(), 4), FormatError);
  EXPECT_THROW(f.add<float>("__metadata__", {4}, v.data(), 4), FormatError);
  EXPECT_THROW(f.add<float>("z", {-1}, v.data(), 4), teo::ShapeError);
}

TEST(SafeTensors, AcceptsAHeaderPaddedWithSpacesAndNoTensors) {
  EXPECT_EQ(rejection(file_of(R"({"__metadata__":{"k":"v"}}    )", "")), "");
  EXPECT_EQ(rejection(file_of("{}", "")), "");
}

struct Bad {
  const char* what;
  std::string bytes;
  const char* message_part;
};

TEST(SafeTensors, RejectsEveryMalformationWithANamedRule) {
  const std::string f32x2(8, '\0');
  const std::string ok_entry = R"("t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  const std::vector<Bad> cases = {
      {"short file", std::string(5, '\0'), "fewer than the 8-byte"},
      {"header past the end", u64le(100) + "{}", "runs past the end"},
      {"header over the limit", u64le(200'000'000) + std::string(16, ' '), "exceeds the limit"},
      {"header too short", u64le(1) + "{", "too short"},
      {"not JSON", file_of("{nope}", ""), "not valid JSON"},
      {"not an object", file_of("[1,2]", ""), "not a JSON object"},
      {"duplicate tensor", file_of("{" + ok_entry + "," + ok_entry + "}", f32x2 + f32x2),
       "repeats the key 't'"},
      {"duplicate inner key",
       file_of(R"({"t":{"dtype":"F32","dtype":"F32","shape":[2],"data_offsets":[0,8]}})", f32x2),
       "repeats the key 'dtype'"},
      {"metadata not object", file_of(R"({"__metadata__":[1]})", ""), "__metadata__ is not"},
      {"metadata value not string", file_of(R"({"__metadata__":{"k":1}})", ""), "not a string"},
      {"entry not object", file_of(R"({"t":3})", ""), "is not an object"},
      {"unknown entry key",
       file_of(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":1}})", f32x2),
       "unknown key 'x'"},
      {"missing key", file_of(R"({"t":{"dtype":"F32","shape":[2]}})", f32x2), "needs dtype"},
      {"unsupported dtype",
       file_of(R"({"t":{"dtype":"C64","shape":[4],"data_offsets":[0,8]}})", f32x2),
       "unsupported dtype 'C64'"},
      {"dtype not string", file_of(R"({"t":{"dtype":7,"shape":[2],"data_offsets":[0,8]}})", f32x2),
       "dtype that is not a string"},
      {"shape not array", file_of(R"({"t":{"dtype":"F32","shape":2,"data_offsets":[0,8]}})", f32x2),
       "shape that is not an array"},
      {"negative dimension",
       file_of(R"({"t":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", f32x2), "negative"},
      {"fractional dimension",
       file_of(R"({"t":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}})", f32x2),
       "not a non-negative integer"},
      {"element count overflow",
       file_of(R"({"t":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}})",
               f32x2),
       "overflows"},
      {"byte size overflow",
       file_of(R"({"t":{"dtype":"F64","shape":[2305843009213693952],"data_offsets":[0,8]}})",
               f32x2),
       "overflows"},
      {"offsets not a pair",
       file_of(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0]}})", f32x2),
       "not [begin, end]"},
      {"end before begin",
       file_of(R"({"t":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})", f32x2), "ends before"},
      {"size mismatch", file_of(R"({"t":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", f32x2),
       "shape and dtype need 12"},
      {"hole", file_of(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})", f32x2 + f32x2),
       "a hole"},
      {"overlap",
       file_of(
           R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"u":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
           f32x2),
       "overlaps"},
      {"trailing bytes", file_of("{" + ok_entry + "}", f32x2 + "x"), "the header says"},
      {"truncated data", file_of("{" + ok_entry + "}", f32x2.substr(0, 5)), "the header says"},
      {"empty name", file_of(R"({"":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}})", ""),
       "empty name"},
  };
  for (const auto& c : cases) {
    const std::string msg = rejection(c.bytes);
    EXPECT_NE(msg.find(c.message_part), std::string::npos) << c.what << ": got \"" << msg << "\"";
    EXPECT_NE(msg.find("test.safetensors"), std::string::npos) << c.what << " names the file";
  }
  st::Limits small;
  small.max_header_bytes = 4;
  EXPECT_NE(rejection(file_of(R"({"k":{}} )", ""), small).find("exceeds the limit"),
            std::string::npos);
}

TEST(SafeTensors, ReadNamesMissingAndNonRegularFiles) {
  EXPECT_THROW(st::read("/nonexistent/x.safetensors"), FileError);
  EXPECT_THROW(st::read(::testing::TempDir()), FileError);
  st::Limits tiny;
  tiny.max_file_bytes = 16;
  const std::string path = ::testing::TempDir() + "teo_st_big.safetensors";
  teo::write_file_atomic(path, st::serialize(sample()), true);
  EXPECT_THROW(st::read(path, tiny), FormatError);
  EXPECT_EQ(st::read(path).tensors.size(), sample().tensors.size());
}

TEST(SafeTensors, AtomicWriteRefusesToOverwriteAndLeavesNoTemporaryFiles) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::path(::testing::TempDir()) / "teo_st_atomic";
  fs::remove_all(dir);
  fs::create_directories(dir);
  const std::string path = (dir / "f.safetensors").string();
  teo::write_file_atomic(path, "first", false);
  EXPECT_THROW(teo::write_file_atomic(path, "second", false), FileError);
  std::ifstream in(path);
  std::string got((std::istreambuf_iterator<char>(in)), {});
  EXPECT_EQ(got, "first") << "a refused write changes nothing";
  teo::write_file_atomic(path, "third", true);
  std::ifstream in2(path);
  EXPECT_EQ(std::string((std::istreambuf_iterator<char>(in2)), {}), "third");
  EXPECT_THROW(teo::write_file_atomic((dir / "no" / "f").string(), "x", true), FileError);
  EXPECT_THROW(teo::write_file_atomic(dir.string(), "x", true), FileError);
  int entries = 0;
  for (const auto& e : fs::directory_iterator(dir)) {
    (void)e;
    ++entries;
  }
  EXPECT_EQ(entries, 1) << "only the target file remains";
}

TEST(Sha256, MatchesPublishedAndCoreutilsDigests) {
  EXPECT_EQ(teo::sha256_hex(""),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(teo::sha256_hex("abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(teo::sha256_hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  // Lengths at the padding boundaries (55, 56, 64 and 119 bytes of 'a'), from sha256sum.
  EXPECT_EQ(teo::sha256_hex(std::string(55, 'a')),
            "9f4390f8d30c2dd92ec9f095b65e2b9ae9b0a925a5258e241c9f1e910f734318");
  EXPECT_EQ(teo::sha256_hex(std::string(56, 'a')),
            "b35439a4ac6f0948b6d6f9e3c6af0f5f590ce20f1bde7090ef7970686ec6738a");
  EXPECT_EQ(teo::sha256_hex(std::string(64, 'a')),
            "ffe054fe7ae0cb6dc65c3af9b61d5209f439851db43d0ba5997337df154668eb");
  EXPECT_EQ(teo::sha256_hex(std::string(119, 'a')),
            "31eba51c313a5c08226adf18d4a359cfdfd8d2e816b13f4af952f7ea6584dcfb");
}

// ---- the streaming writer and the mapped reader ----------------------------------------------

namespace fs = std::filesystem;

// A fresh, empty directory for one test.
fs::path fresh_dir(const std::string& name) {
  const fs::path dir =
      fs::temp_directory_path() / ("teo_st_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

std::vector<st::Entry> entries_of(const st::File& f) {
  std::vector<st::Entry> e;
  for (const auto& t : f.tensors) e.push_back({t.name, t.dtype, t.shape});
  return e;
}

int files_in(const fs::path& dir) {
  int n = 0;
  for (const auto& e : fs::directory_iterator(dir)) n += e.is_regular_file() ? 1 : 0;
  return n;
}

TEST(SafeTensorsWriter, GivesSerializesBytesWhateverTheWriteOrder) {
  const fs::path dir = fresh_dir("order");
  const st::File f = sample();
  const std::string path = (dir / "w.safetensors").string();
  {
    st::Writer w(path, f.metadata, entries_of(f), /*overwrite=*/false);
    EXPECT_FALSE(fs::exists(path)) << "nothing under the final name before commit";
    for (auto it = f.tensors.rbegin(); it != f.tensors.rend(); ++it)
      w.write(it->name, it->bytes.data(), it->bytes.size());
    const st::File mapped = w.contents();
    ASSERT_EQ(mapped.tensors.size(), f.tensors.size());
    for (std::size_t i = 0; i < f.tensors.size(); ++i) {
      const auto a = mapped.tensors[i].data();
      EXPECT_TRUE(
          std::equal(a.begin(), a.end(), f.tensors[i].bytes.begin(), f.tensors[i].bytes.end()))
          << f.tensors[i].name;
      EXPECT_NE(mapped.tensors[i].mapped, nullptr);
    }
    EXPECT_EQ(w.commit(), st::serialize(f).size());
  }
  EXPECT_TRUE(teo::test::slurp(path) == st::serialize(f));
  EXPECT_EQ(files_in(dir), 1) << "no temporary file is left";
  fs::remove_all(dir);
}

TEST(SafeTensorsWriter, MetadataChangedBeforeCommitMovesTheData) {
  const fs::path dir = fresh_dir("meta");
  st::File f = sample();
  for (const auto& extra : {std::string(1, 'x'), std::string(100, 'y'), std::string()}) {
    const std::string path = (dir / "m.safetensors").string();
    st::Writer w(path, f.metadata, entries_of(f), /*overwrite=*/true);
    for (const auto& t : f.tensors) w.write(t.name, t.bytes.data(), t.bytes.size());
    st::File g = f;
    if (!extra.empty()) g.metadata.emplace_back("added", extra);  // a longer header, or the same
    w.set_metadata(g.metadata);
    w.commit();
    EXPECT_TRUE(teo::test::slurp(path) == st::serialize(g)) << "metadata of " << extra.size();
    EXPECT_EQ(files_in(dir), 1);
  }
  fs::remove_all(dir);
}

TEST(SafeTensorsWriter, AnAbandonedOrRefusedWriteLeavesNothing) {
  const fs::path dir = fresh_dir("abandon");
  const st::File f = sample();
  const std::string path = (dir / "a.safetensors").string();
  {
    st::Writer w(path, f.metadata, entries_of(f), false);
    w.write("a", f.find("a")->bytes.data(), f.find("a")->bytes.size());
    EXPECT_EQ(files_in(dir), 1) << "the temporary file";
    teo::test::expect_throw<FormatError>([&] { w.write("zz", "", 0); }, "zz is not in the header");
    teo::test::expect_throw<FormatError>(
        [&] { w.write("a", f.find("a")->bytes.data(), f.find("a")->bytes.size()); },
        "a is written twice");
    teo::test::expect_throw<FormatError>([&] { w.write("b", "12345678", 8); },
                                         "has 8 bytes, its shape needs 16");
    teo::test::expect_throw<FormatError>([&] { w.commit(); }, "has not been written");
    teo::test::expect_throw<FormatError>([&] { w.contents(); }, "has not been written");
  }
  EXPECT_FALSE(fs::exists(path));
  EXPECT_EQ(files_in(dir), 0) << "the destructor removed the temporary file";
  // an existing file without overwrite, a repeated name, a missing directory: refused up front
  teo::write_file_atomic(path, "old", false);
  EXPECT_THROW(st::Writer(path, {}, entries_of(f), false), FileError);
  std::vector<st::Entry> twice = {{"x", st::DType::F32, {1}}, {"x", st::DType::F32, {1}}};
  teo::test::expect_throw<FormatError>([&] { st::Writer(path, {}, twice, true); },
                                       "duplicate tensor name x");
  EXPECT_THROW(st::Writer((dir / "no" / "f").string(), {}, {}, true), FileError);
  EXPECT_EQ(teo::test::slurp(path), "old");
  EXPECT_EQ(files_in(dir), 1);
  fs::remove_all(dir);
}

TEST(SafeTensorsMap, GivesWhatReadGivesAndTheSameErrors) {
  const fs::path dir = fresh_dir("map");
  const st::File f = sample();
  const std::string path = (dir / "f.safetensors").string();
  teo::write_file_atomic(path, st::serialize(f), false);
  const st::File r = st::read(path);
  st::File m = st::map(path);
  EXPECT_EQ(m.metadata, r.metadata);
  ASSERT_EQ(m.tensors.size(), r.tensors.size());
  for (std::size_t i = 0; i < r.tensors.size(); ++i) {
    EXPECT_EQ(m.tensors[i].name, r.tensors[i].name);
    EXPECT_EQ(m.tensors[i].shape, r.tensors[i].shape);
    EXPECT_TRUE(m.tensors[i].bytes.empty()) << "a view owns no bytes";
    const auto a = m.tensors[i].data();
    EXPECT_TRUE(
        std::equal(a.begin(), a.end(), r.tensors[i].bytes.begin(), r.tensors[i].bytes.end()));
    st::release(m.tensors[i]);  // the pages go, the values stay readable
    EXPECT_TRUE(
        std::equal(a.begin(), a.end(), r.tensors[i].bytes.begin(), r.tensors[i].bytes.end()));
  }
  const st::File copy = m;  // the mapping lives as long as any copy
  m = st::File();
  EXPECT_EQ(copy.find("b")->values<double>()[1], -1e300);
  // a truncated file and a missing one: the errors read() gives
  const std::string bytes = st::serialize(f);
  teo::write_file_atomic(path, bytes.substr(0, bytes.size() - 1), true);
  std::string read_msg, map_msg;
  try {
    st::read(path);
  } catch (const FormatError& e) {
    read_msg = e.what();
  }
  try {
    st::map(path);
  } catch (const FormatError& e) {
    map_msg = e.what();
  }
  EXPECT_FALSE(map_msg.empty());
  EXPECT_EQ(map_msg, read_msg);
  teo::write_file_atomic(path, "", true);
  EXPECT_THROW(st::map(path), FormatError);
  EXPECT_THROW(st::map((dir / "missing").string()), FileError);
  fs::remove_all(dir);
}

long peak_rss_kb() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_maxrss;
}

long current_rss_kb() {
  std::ifstream in("/proc/self/statm");
  long pages = 0, resident = 0;
  in >> pages >> resident;
  return resident * (::sysconf(_SC_PAGESIZE) / 1024);
}

#if defined(__SANITIZE_ADDRESS__)
constexpr bool kSanitized = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
constexpr bool kSanitized = true;
#else
constexpr bool kSanitized = false;
#endif
#else
constexpr bool kSanitized = false;
#endif

// A memory ceiling, not a timing: checking a 2 GiB golden against itself (4 GiB of files) holds
// about one tensor of each file at a time, so the process's peak RSS grows by far less than a
// file. The synthetic golden is a float64 case of 32 tensors of 64 MiB, written with the Writer.
TEST(SafeTensorsMap, CheckOfATwoGigabyteFileStaysUnderAMemoryCeiling) {
  if (kSanitized) GTEST_SKIP() << "AddressSanitizer's shadow memory and quarantine change the RSS";
  const fs::path dir = fresh_dir("ceiling");
  const std::string path = (dir / "big.safetensors").string();
  // A float64 golden of two layers whose (B, S, D) tensors are 64 MiB each: about 2 GiB in all,
  // every tensor the contract's.
  teo::golden::Case c;
  c.config.d_model = 1024;
  c.config.attention.num_heads = 1;
  c.config.ffn.d_ff = 1024;
  c.config.embeddings.max_len = 1024;
  c.config.num_layers = 2;
  c.batch = 8;
  c.seq_len = 1024;
  const std::vector<std::pair<std::string, std::string>> meta = {
      {"format", teo::golden::kFormat},
      {"config", c.config.to_json().dump()},
      {"case", c.case_json().dump()}};
  std::vector<st::Entry> entries;
  std::int64_t judged = 0;
  for (const auto& t : teo::contract::model_case(c.config, {c.batch, c.seq_len}, false)) {
    entries.push_back({t.name,
                       t.dtype == teo::contract::DTypeRule::i64 ? st::DType::I64 : st::DType::F64,
                       t.shape});
    if (t.role == teo::contract::Role::act || t.role == teo::contract::Role::grad) ++judged;
  }
  {
    st::Writer w(path, meta, entries, true);
    for (std::size_t i = 0; i < entries.size(); ++i) {
      const auto& e = entries[i];
      const auto n = static_cast<std::size_t>(teo::Shape(e.shape).numel());
      if (e.dtype == st::DType::I64) {
        // tokens and labels 0, every sequence full
        std::vector<std::int64_t> v(n, e.name == "input.lengths" ? c.seq_len : 0);
        w.write(e.name, v.data(), v.size());
        continue;
      }
      std::vector<double> v(n);
      for (std::size_t k = 0; k < v.size(); ++k)
        v[k] = static_cast<double>(i) + 1e-3 * static_cast<double>(k % 997);
      w.write(e.name, v.data(), v.size());
    }
    w.commit();
  }
  ASSERT_GT(fs::file_size(path), std::uint64_t{2000} << 20);
  const long before = current_rss_kb();
  const auto reports = teo::golden::check_paths(path, path, {});
  const long grew_mb = (peak_rss_kb() - before) / 1024;
  ASSERT_EQ(reports.size(), 1u);
  EXPECT_EQ(reports[0].passed, judged);
  EXPECT_EQ(reports[0].failed, 0);
  // one tensor's values from each file (2 x 64 MiB as doubles) plus one tensor's pages at a time;
  // reading both files whole would take 4096 MiB
  EXPECT_LT(grew_mb, 512) << "the check's peak RSS grew by " << grew_mb << " MiB";
  std::cout << "check of a 2 GiB file against itself: peak RSS grew by " << grew_mb << " MiB\n";
  fs::remove_all(dir);
}

}  // namespace
