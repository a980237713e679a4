// The GGUF container (teo/gguf.hpp): a file laid out here by hand from the format's description
// reads as itself, every file teo writes reads back and writes again byte for byte, and each rule
// of the reader is a named FormatError, never a crash, with nothing written on a failed write.
#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "teo/errors.hpp"
#include "teo/gguf.hpp"
#include "teo/quant.hpp"

namespace {

namespace gguf = teo::gguf;
using teo::quant::GgmlType;

// A little-endian byte writer for laying files out by hand.
struct Bytes {
  std::string b;
  template <class T>
  Bytes& raw(T v) {
    b.append(reinterpret_cast<const char*>(&v), sizeof v);
    return *this;
  }
  Bytes& str(const std::string& s) {
    raw<std::uint64_t>(s.size());
    b += s;
    return *this;
  }
  Bytes& pad(std::size_t a) {
    b.resize((b.size() + a - 1) / a * a, '\0');
    return *this;
  }
};

// A file by the format's description: 2 metadata pairs (a UINT32 and an ARRAY of 2 STRING), one
// Q8_0 tensor of dims {32, 2} (two blocks of d = 1.0, values 0..31 and -1..-32) and an F32 {3}.
std::string hand_made() {
  Bytes f;
  f.raw<std::uint32_t>(0x46554747)
      .raw<std::uint32_t>(3)
      .raw<std::uint64_t>(2)
      .raw<std::uint64_t>(2);
  f.str("test.count").raw<std::uint32_t>(4).raw<std::uint32_t>(7);
  f.str("test.names").raw<std::uint32_t>(9).raw<std::uint32_t>(8).raw<std::uint64_t>(2);
  f.str("a").str("bé");
  f.str("w").raw<std::uint32_t>(2).raw<std::uint64_t>(32).raw<std::uint64_t>(2);
  f.raw<std::uint32_t>(8).raw<std::uint64_t>(0);
  f.str("bias").raw<std::uint32_t>(1).raw<std::uint64_t>(3);
  f.raw<std::uint32_t>(0).raw<std::uint64_t>(96);  // 68 bytes of Q8_0, padded to 96
  f.pad(32);
  for (int blk = 0; blk < 2; ++blk) {
    f.raw<std::uint16_t>(0x3C00);  // 1.0
    for (int j = 0; j < 32; ++j) f.raw<std::int8_t>(static_cast<std::int8_t>(blk ? -1 - j : j));
  }
  f.pad(32);
  for (float v : {0.5f, -2.0f, 3.25f}) f.raw<float>(v);
  f.pad(32);
  return f.b;
}

TEST(Gguf, AFileLaidOutByHandReadsAsItselfAndWritesBackByteForByte) {
  const std::string bytes = hand_made();
  const gguf::File f = gguf::parse(bytes, "hand");
  ASSERT_EQ(f.metadata.size(), 2u);
  EXPECT_EQ(f.metadata[0].first, "test.count");
  EXPECT_EQ(f.metadata[0].second.u, 7u);
  EXPECT_EQ(f.metadata[1].second.items.size(), 2u);
  EXPECT_EQ(f.metadata[1].second.items[1].s, "bé");
  ASSERT_EQ(f.tensors.size(), 2u);
  EXPECT_EQ(f.tensors[0].type, GgmlType::q8_0);
  EXPECT_EQ(f.tensors[0].shape_str(), "[2, 32]");
  const auto w = f.tensors[0].values();
  for (int j = 0; j < 32; ++j) {
    EXPECT_EQ(w[j], static_cast<float>(j));
    EXPECT_EQ(w[32 + j], static_cast<float>(-1 - j));
  }
  EXPECT_EQ(f.tensors[1].values(), (std::vector<float>{0.5f, -2.0f, 3.25f}));
  EXPECT_EQ(gguf::serialize(f), bytes);
}

// Every value type, nested arrays, a NaN with a payload, every ggml type and alignment 64.
gguf::File everything() {
  gguf::File f;
  f.set("general.alignment", gguf::Value::of_u32(64));
  gguf::Value v;
  for (auto [t, u, i] : {std::tuple{gguf::ValueType::u8, 200u, 0},
                         {gguf::ValueType::i8, 0u, -9},
                         {gguf::ValueType::u16, 65535u, 0},
                         {gguf::ValueType::i16, 0u, -300},
                         {gguf::ValueType::u64, 0xFFFFFFFFu, 0},
                         {gguf::ValueType::i64, 0u, -7}}) {
    v = {};
    v.type = t;
    v.u = u;
    v.i = i;
    f.set(std::string("t.") + gguf::to_string(t), v);
  }
  f.set("t.nan", gguf::Value::of_f32(std::bit_cast<float>(0x7FA00001u)));
  f.set("t.bool", gguf::Value::of_bool(true));
  gguf::Value nested;
  nested.type = gguf::ValueType::array;
  nested.item_type = gguf::ValueType::array;
  nested.items = {gguf::Value::of_strings({"x", "y"}), gguf::Value::of_strings({})};
  f.set("t.nested", nested);
  std::mt19937 rng(3);
  for (GgmlType t : teo::quant::ggml_types()) {
    const auto shape = teo::quant::block_shape(t);
    std::vector<float> x(static_cast<std::size_t>(shape.values * 2 * 3));
    std::normal_distribution<float> normal;
    for (auto& e : x) e = normal(rng);
    std::vector<std::uint8_t> q(static_cast<std::size_t>(shape.bytes * 2 * 3));
    for (int k = 0; k < 6; ++k)
      teo::quant::quantize_block(t, x.data() + k * shape.values, q.data() + k * shape.bytes);
    f.add(std::string("w.") + teo::quant::to_string(t), t, {shape.values * 2, 3}, q);
  }
  return f;
}

TEST(Gguf, EveryTypeAndValueRoundTripsThroughParseAndSerialize) {
  const gguf::File f = everything();
  const std::string bytes = gguf::serialize(f);
  const gguf::File g = gguf::parse(bytes, "round trip");
  EXPECT_EQ(gguf::serialize(g), bytes);
  ASSERT_EQ(g.metadata.size(), f.metadata.size());
  for (std::size_t k = 0; k < f.metadata.size(); ++k) {
    EXPECT_EQ(g.metadata[k].first, f.metadata[k].first);
    EXPECT_TRUE(g.metadata[k].second == f.metadata[k].second) << f.metadata[k].first;
  }
  EXPECT_EQ(g.meta("t.nan")->u, 0x7FA00001u) << "a NaN's payload is kept";
  EXPECT_EQ(g.alignment(), 64u);
  for (std::size_t k = 0; k < f.tensors.size(); ++k) {
    EXPECT_EQ(g.tensors[k].dims, f.tensors[k].dims);
    EXPECT_EQ(std::vector<std::uint8_t>(g.tensors[k].data().begin(), g.tensors[k].data().end()),
              f.tensors[k].bytes)
        << f.tensors[k].name;
  }
  // Each tensor's data starts at a multiple of 64.
  const auto path = (std::filesystem::temp_directory_path() / "teo_gguf_test.gguf").string();
  std::filesystem::remove(path);
  gguf::write(f, path, false);
  const gguf::File m = gguf::map(path), r = gguf::read(path);
  EXPECT_EQ(gguf::serialize(m), bytes);
  EXPECT_EQ(gguf::serialize(r), bytes);
  for (const auto& t : m.tensors)
    EXPECT_EQ((t.data().data() - static_cast<const std::uint8_t*>(m.backing.get())) % 64, 0);
  // A failed write leaves the file as it was.
  EXPECT_THROW(gguf::write(gguf::File{}, path, false), teo::FileError);
  EXPECT_EQ(gguf::serialize(gguf::read(path)), bytes);
  std::filesystem::remove(path);
}

// parse() of `bytes` throws a FormatError whose message holds `what`.
void expect_refused(const std::string& bytes, const std::string& what) {
  try {
    gguf::parse(bytes, "bad");
    ADD_FAILURE() << "accepted; expected: " << what;
  } catch (const teo::FormatError& e) {
    EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
  }
}

// The hand-made file with `len` bytes at `at` replaced by `with`.
std::string patched(std::size_t at, const std::string& with) {
  std::string b = hand_made();
  b.replace(at, with.size(), with);
  return b;
}

template <class T>
std::string le(T v) {
  return std::string(reinterpret_cast<const char*>(&v), sizeof v);
}

TEST(Gguf, EveryRuleOfTheReaderIsANamedError) {
  const std::string good = hand_made();
  // Every truncation is refused by name (and none crashes), but of the last tensor's padding.
  for (std::size_t n = 0; n + 20 < good.size(); ++n)
    EXPECT_THROW(gguf::parse(good.substr(0, n), "cut"), teo::FormatError) << n;
  for (std::size_t n = good.size() - 20; n < good.size(); ++n)
    EXPECT_NO_THROW(gguf::parse(good.substr(0, n), "cut")) << n;
  expect_refused(good.substr(0, 200), "past the end of the file");
  expect_refused(patched(0, "GGUG"), "not a GGUF file");
  expect_refused(patched(4, le<std::uint32_t>(1)), "GGUF version 1");
  expect_refused(patched(4, le<std::uint32_t>(0x03000000)), "big-endian");
  expect_refused(patched(16, le<std::uint64_t>(std::uint64_t{1} << 40)),
                 "metadata pairs cannot fit");
  // the first key's length (at 24) and its type (at 42)
  expect_refused(patched(42, le<std::uint32_t>(13)), "unknown value type 13");
  expect_refused(patched(42, le<std::uint32_t>(7)), "a BOOL is 0 or 1");
  expect_refused(patched(32, "test.names"), "test.names appears twice");
  // "test.count" renamed general.alignment: a UINT32, but 7 is no power of two
  {
    std::string b = good;
    const std::string key = "general.alignment";
    b.replace(24, 8 + 10, le<std::uint64_t>(key.size()) + key);
    expect_refused(b, "general.alignment must be a UINT32 power of two");
  }
  expect_refused(patched(good.find("bé"), "b\xff"), "not UTF-8");
  {
    gguf::Limits small;
    small.max_metadata_items = 1;  // the file's array has 2
    EXPECT_THROW(gguf::parse(good, "small", small), teo::FormatError);
  }
  const std::size_t w = good.find("w\x02");  // tensor w's name, then its dimension count
  expect_refused(patched(w + 1, le<std::uint32_t>(5)), "GGUF allows 1 to 4");
  expect_refused(patched(w + 5, le<std::uint64_t>(0)), "a dimension of 0");
  expect_refused(patched(w + 5, le<std::uint64_t>(16)), "not whole Q8_0 blocks of 32");
  expect_refused(patched(w + 21, le<std::uint32_t>(16)), "ggml type 16 (IQ2_XXS)");
  expect_refused(patched(w + 21, le<std::uint32_t>(77)), "ggml type 77, which teo does not read");
  expect_refused(patched(w + 25, le<std::uint64_t>(32)), "expected 0");
  expect_refused(patched(good.find("bias") - 8, le<std::uint64_t>(1) + "w"), "appears twice");
  expect_refused(good + std::string(32, '\0'), "bytes follow the last tensor");
  // Sizes that would wrap a 64-bit byte count or offset, and one larger than the file.
  const std::size_t bias_dim = good.find("bias") + 4 + 4;
  expect_refused(patched(bias_dim, le<std::uint64_t>((std::uint64_t{1} << 62) - 1)),
                 "tensor bias has more than 2^62 bytes");
  expect_refused(patched(bias_dim, le<std::uint64_t>(std::uint64_t{1} << 62)),
                 "tensor bias has more than 2^62 bytes");
  expect_refused(patched(bias_dim, le<std::uint64_t>(std::uint64_t{1} << 60)),
                 "tensor bias needs 4611686018427387904 bytes, more than the file's");
  const std::size_t data = good.size() - 32 - 96;  // the Q8_0 tensor's data
  expect_refused(patched(data + 1, "\x7c"), "tensor w, block 0 (values 0 to 31): its F16 scale d");
  expect_refused(patched(data + 34 + 1, "\xfe"), "tensor w, block 1 (values 32 to 63)");
  expect_refused(patched(data - 1, "\x01"), "padding before the tensors' data is not zero");
  expect_refused(patched(data + 70, "\x01"), "padding after tensor w is not zero");
  expect_refused(patched(good.size() - 32, le<float>(INFINITY)), "tensor bias, block 0");
  // And the File builder's rules.
  gguf::File f;
  EXPECT_THROW(f.add("x", GgmlType::q4_k, {128, 1}, {}), teo::ShapeError);
  EXPECT_THROW(f.add("x", GgmlType::f32, {std::int64_t{1} << 62}, {}), teo::ShapeError);
  EXPECT_THROW(f.add(std::string(64, 'x'), GgmlType::f32, {1}, std::vector<std::uint8_t>(4)),
               teo::FormatError);
  EXPECT_THROW(f.add("x", GgmlType::f32, {2}, std::vector<std::uint8_t>(4)), teo::FormatError);
  f.add("x", GgmlType::f32, {1}, std::vector<std::uint8_t>(4));
  EXPECT_THROW(f.add("x", GgmlType::f32, {1}, std::vector<std::uint8_t>(4)), teo::FormatError);
}

}  // namespace
