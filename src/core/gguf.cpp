// GGUF files (teo/gguf.hpp): a bounds-checked cursor over the bytes, the layout of llama.cpp's
// docs/gguf.md, and the rules llama.cpp's own loader (ggml/src/gguf.cpp) enforces, each failure a
// FormatError naming the file and the rule.
#include "teo/gguf.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <fstream>
#include <set>

#include "teo/errors.hpp"
#include "teo/files.hpp"

namespace teo::gguf {

static_assert(std::endian::native == std::endian::little, "GGUF is read as little-endian");

namespace {

constexpr std::uint32_t kMagic = 0x46554747;  // "GGUF" read as a little-endian uint32
constexpr std::uint64_t kDefaultAlignment = 32;
constexpr std::size_t kMaxName = 64;  // GGML_MAX_NAME, with the terminating NUL
constexpr int kMaxDims = 4;           // GGML_MAX_DIMS
constexpr int kMaxDepth = 8;

// The size of one value of a fixed-size type; 0 for string and array.
std::size_t fixed_size(ValueType t) {
  switch (t) {
    case ValueType::u8:
    case ValueType::i8:
    case ValueType::boolean:
      return 1;
    case ValueType::u16:
    case ValueType::i16:
      return 2;
    case ValueType::u32:
    case ValueType::i32:
    case ValueType::f32:
      return 4;
    case ValueType::u64:
    case ValueType::i64:
    case ValueType::f64:
      return 8;
    case ValueType::string:
    case ValueType::array:
      return 0;
  }
  return 0;
}

bool known(std::uint32_t t) {
  return t <= static_cast<std::uint32_t>(ValueType::f64);
}

bool valid_utf8(std::string_view s) {
  std::size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    int extra = 0;
    std::uint32_t cp = 0;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c & 0xE0) == 0xC0) {
      extra = 1;
      cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      extra = 2;
      cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      extra = 3;
      cp = c & 0x07;
    } else {
      return false;
    }
    if (i + static_cast<std::size_t>(extra) >= s.size()) return false;
    for (int k = 1; k <= extra; ++k) {
      const auto d = static_cast<unsigned char>(s[i + k]);
      if ((d & 0xC0) != 0x80) return false;
      cp = cp << 6 | (d & 0x3F);
    }
    // No overlong forms, no surrogates, nothing past U+10FFFF.
    static constexpr std::uint32_t kMin[] = {0, 0x80, 0x800, 0x10000};
    if (cp < kMin[extra] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    i += static_cast<std::size_t>(extra) + 1;
  }
  return true;
}

class Cursor {
 public:
  Cursor(std::string_view b, const std::string& source) : b_(b), source_(source) {}

  [[noreturn]] void fail(const std::string& why) const {
    throw FormatError(source_ + ": " + why + " (at byte " + std::to_string(at_) + ")");
  }
  std::uint64_t at() const { return at_; }
  std::uint64_t left() const { return b_.size() - at_; }

  template <class T>
  T get(const char* what) {
    if (left() < sizeof(T)) fail(std::string("the file ends inside ") + what);
    T v;
    std::memcpy(&v, b_.data() + at_, sizeof(T));
    at_ += sizeof(T);
    return v;
  }

  std::string string(const char* what) {
    const auto n = get<std::uint64_t>(what);
    if (n > left()) {
      fail(std::string(what) + " is " + std::to_string(n) +
           " bytes long, past the end of the file");
    }
    std::string s(b_.substr(at_, n));
    at_ += n;
    if (!valid_utf8(s)) fail(std::string(what) + " is not UTF-8");
    return s;
  }

 private:
  std::string_view b_;
  const std::string& source_;
  std::uint64_t at_ = 0;
};

Value read_value(Cursor& c, ValueType t, const std::string& key, const Limits& limits, int depth,
                 std::uint64_t& items) {
  Value v;
  v.type = t;
  switch (t) {
    case ValueType::u8:
      v.u = c.get<std::uint8_t>("a value");
      break;
    case ValueType::i8:
      v.i = static_cast<std::int64_t>(static_cast<int>(c.get<std::int8_t>("a value")));
      break;
    case ValueType::u16:
      v.u = c.get<std::uint16_t>("a value");
      break;
    case ValueType::i16:
      v.i = c.get<std::int16_t>("a value");
      break;
    case ValueType::u32:
      v.u = c.get<std::uint32_t>("a value");
      break;
    case ValueType::i32:
      v.i = c.get<std::int32_t>("a value");
      break;
    case ValueType::u64:
      v.u = c.get<std::uint64_t>("a value");
      break;
    case ValueType::i64:
      v.i = c.get<std::int64_t>("a value");
      break;
    case ValueType::f32:
      v.u = c.get<std::uint32_t>("a value");
      v.f = std::bit_cast<float>(static_cast<std::uint32_t>(v.u));
      break;
    case ValueType::f64:
      v.u = c.get<std::uint64_t>("a value");
      v.f = std::bit_cast<double>(v.u);
      break;
    case ValueType::boolean: {
      const auto b = c.get<std::uint8_t>("a value");
      if (b > 1) c.fail("metadata " + key + ": a BOOL is 0 or 1, got " + std::to_string(b));
      v.i = b;
      break;
    }
    case ValueType::string:
      v.s = c.string("a string value");
      break;
    case ValueType::array: {
      if (depth >= kMaxDepth) {
        c.fail("metadata " + key + ": arrays nested more than " + std::to_string(kMaxDepth) +
               " deep");
      }
      const auto it = c.get<std::uint32_t>("an array's type");
      if (!known(it)) c.fail("metadata " + key + ": unknown array type " + std::to_string(it));
      v.item_type = static_cast<ValueType>(it);
      const auto n = c.get<std::uint64_t>("an array's length");
      // Every item takes at least one byte (a string its 8-byte length), so a count the rest of
      // the file cannot hold is refused before anything is allocated.
      const std::size_t least = v.item_type == ValueType::string  ? 8
                                : v.item_type == ValueType::array ? 12
                                                                  : fixed_size(v.item_type);
      if (n > c.left() / least) {
        c.fail("metadata " + key + ": an array of " + std::to_string(n) + " " +
               to_string(v.item_type) + " items cannot fit in the file");
      }
      // Each item is held as a Value (about 100 bytes), so the items of all arrays together are
      // bounded too.
      if (n > limits.max_metadata_items - std::min(items, limits.max_metadata_items)) {
        c.fail("metadata " + key + ": an array of " + std::to_string(n) +
               " items takes the metadata past its limit of " +
               std::to_string(limits.max_metadata_items) + " items");
      }
      items += n;
      v.items.reserve(n);
      for (std::uint64_t k = 0; k < n; ++k)
        v.items.push_back(read_value(c, v.item_type, key, limits, depth + 1, items));
      break;
    }
  }
  return v;
}

void put_bytes(std::string& out, const void* p, std::size_t n) {
  out.append(static_cast<const char*>(p), n);
}

template <class T>
void put(std::string& out, T v) {
  put_bytes(out, &v, sizeof v);
}

void put_string(std::string& out, const std::string& s) {
  put<std::uint64_t>(out, s.size());
  out += s;
}

void write_value(std::string& out, const Value& v) {
  switch (v.type) {
    case ValueType::u8:
      put(out, static_cast<std::uint8_t>(v.u));
      break;
    case ValueType::i8:
      put(out, static_cast<std::int8_t>(v.i));
      break;
    case ValueType::u16:
      put(out, static_cast<std::uint16_t>(v.u));
      break;
    case ValueType::i16:
      put(out, static_cast<std::int16_t>(v.i));
      break;
    case ValueType::u32:
      put(out, static_cast<std::uint32_t>(v.u));
      break;
    case ValueType::i32:
      put(out, static_cast<std::int32_t>(v.i));
      break;
    case ValueType::u64:
      put(out, v.u);
      break;
    case ValueType::i64:
      put(out, v.i);
      break;
    case ValueType::f32:
      put(out, static_cast<std::uint32_t>(v.u));
      break;
    case ValueType::f64:
      put(out, v.u);
      break;
    case ValueType::boolean:
      put(out, static_cast<std::uint8_t>(v.i != 0));
      break;
    case ValueType::string:
      put_string(out, v.s);
      break;
    case ValueType::array:
      put(out, static_cast<std::uint32_t>(v.item_type));
      put<std::uint64_t>(out, v.items.size());
      for (const auto& item : v.items) write_value(out, item);
      break;
  }
}

std::uint64_t round_up(std::uint64_t x, std::uint64_t a) {
  return (x + a - 1) / a * a;
}

// The byte size of a tensor, checking its shape: "" or the reason it is not a tensor.
std::string shape_error(quant::GgmlType type, const std::vector<std::int64_t>& dims,
                        std::uint64_t& bytes) {
  if (dims.empty() || dims.size() > kMaxDims) {
    return "has " + std::to_string(dims.size()) + " dimensions (GGUF allows 1 to 4)";
  }
  std::uint64_t n = 1;
  for (const auto d : dims) {
    if (d < 1) return "has a dimension of " + std::to_string(d) + " (each is at least 1)";
    if (static_cast<std::uint64_t>(d) > (std::uint64_t{1} << 62) / n) {
      return "has more than 2^62 elements";
    }
    n *= static_cast<std::uint64_t>(d);
  }
  const auto shape = quant::block_shape(type);
  if (dims[0] % shape.values != 0) {
    return "has " + std::to_string(dims[0]) + " values in a row (dims[0]), not whole " +
           quant::to_string(type) + " blocks of " + std::to_string(shape.values);
  }
  const std::uint64_t blocks = n / static_cast<std::uint64_t>(shape.values);
  if (blocks > (std::uint64_t{1} << 62) / static_cast<std::uint64_t>(shape.bytes)) {
    return "has more than 2^62 bytes";
  }
  bytes = blocks * static_cast<std::uint64_t>(shape.bytes);
  return "";
}

File parse_bytes(std::string_view b, const std::string& source, const Limits& limits, bool view) {
  Cursor c(b, source);
  if (b.size() > limits.max_file_bytes) {
    c.fail("the file is " + std::to_string(b.size()) + " bytes, more than the limit of " +
           std::to_string(limits.max_file_bytes));
  }
  if (b.size() < 24)
    c.fail("a GGUF file is at least 24 bytes, this one is " + std::to_string(b.size()));
  if (c.get<std::uint32_t>("the magic") != kMagic) c.fail("not a GGUF file (no \"GGUF\" magic)");
  File f;
  f.version = c.get<std::uint32_t>("the version");
  if (f.version != 2 && f.version != 3) {
    if (f.version == 0x02000000u || f.version == 0x03000000u) {  // 2 or 3, byte-swapped
      c.fail("a big-endian GGUF file: teo reads little-endian GGUF");
    }
    c.fail("GGUF version " + std::to_string(f.version) + ": teo reads versions 2 and 3");
  }
  const auto n_tensors = c.get<std::uint64_t>("the tensor count");
  const auto n_kv = c.get<std::uint64_t>("the metadata count");
  // A key-value pair takes at least 8 + 1 + 4 + 1 bytes, a tensor info 8 + 1 + 4 + 8 + 4 + 8.
  if (n_kv > c.left() / 14) c.fail(std::to_string(n_kv) + " metadata pairs cannot fit in the file");
  if (n_tensors > c.left() / 33) {
    c.fail(std::to_string(n_tensors) + " tensor infos cannot fit in the file");
  }
  std::set<std::string> keys;
  std::uint64_t items = 0;
  for (std::uint64_t k = 0; k < n_kv; ++k) {
    std::string key = c.string("a metadata key");
    if (key.empty()) c.fail("a metadata key is empty");
    if (!keys.insert(key).second) c.fail("metadata key " + key + " appears twice");
    const auto t = c.get<std::uint32_t>("a metadata type");
    if (!known(t)) c.fail("metadata " + key + ": unknown value type " + std::to_string(t));
    Value v = read_value(c, static_cast<ValueType>(t), key, limits, 0, items);
    f.metadata.emplace_back(std::move(key), std::move(v));
  }
  if (const Value* a = f.meta("general.alignment")) {
    if (a->type != ValueType::u32 || a->u == 0 || (a->u & (a->u - 1)) != 0) {
      c.fail("general.alignment must be a UINT32 power of two");
    }
  }
  const std::uint64_t align = f.alignment();
  std::set<std::string> names;
  std::vector<std::uint64_t> offsets, sizes;
  std::uint64_t expected = 0;
  for (std::uint64_t k = 0; k < n_tensors; ++k) {
    Tensor t;
    t.name = c.string("a tensor name");
    if (t.name.empty() || t.name.size() >= kMaxName) {
      c.fail("tensor name \"" + t.name + "\" must be 1 to " + std::to_string(kMaxName - 1) +
             " bytes");
    }
    if (!names.insert(t.name).second) c.fail("tensor " + t.name + " appears twice");
    const auto n_dims = c.get<std::uint32_t>("a tensor's dimension count");
    if (n_dims == 0 || n_dims > kMaxDims) {
      c.fail("tensor " + t.name + " has " + std::to_string(n_dims) +
             " dimensions (GGUF allows 1 to 4)");
    }
    for (std::uint32_t d = 0; d < n_dims; ++d) {
      const auto ne = c.get<std::uint64_t>("a tensor's dimensions");
      if (ne > (std::uint64_t{1} << 62)) c.fail("tensor " + t.name + ": a dimension over 2^62");
      t.dims.push_back(static_cast<std::int64_t>(ne));
    }
    const auto type = c.get<std::uint32_t>("a tensor's type");
    if (!quant::ggml_type_of(type, t.type)) {
      const std::string name = quant::ggml_type_name(type);
      c.fail("tensor " + t.name + " has ggml type " + std::to_string(type) +
             (name.empty() ? "" : " (" + name + ")") + ", which teo does not read");
    }
    std::uint64_t size = 0;
    if (const auto why = shape_error(t.type, t.dims, size); !why.empty()) {
      c.fail("tensor " + t.name + " " + why);
    }
    if (size > b.size()) {
      c.fail("tensor " + t.name + " needs " + std::to_string(size) +
             " bytes, more than the file's " + std::to_string(b.size()));
    }
    const auto offset = c.get<std::uint64_t>("a tensor's offset");
    if (offset != expected) {
      c.fail("tensor " + t.name + " is at offset " + std::to_string(offset) + ", expected " +
             std::to_string(expected) + " (each tensor follows the previous one, aligned to " +
             std::to_string(align) + ")");
    }
    offsets.push_back(offset);
    sizes.push_back(size);
    // offset (= expected) and size are each at most the file's size, so neither this sum nor the
    // data's end below can wrap; past the file, the data cannot be there.
    expected = round_up(offset + size, align);
    if (expected > b.size()) {
      c.fail("tensor " + t.name + "'s data ends past the end of the file (" +
             std::to_string(b.size()) + " bytes)");
    }
    f.tensors.push_back(std::move(t));
  }
  const std::uint64_t data = round_up(c.at(), align);
  const std::uint64_t end = f.tensors.empty() ? c.at() : data + offsets.back() + sizes.back();
  if (end > b.size()) {
    c.fail("the tensors' data ends at byte " + std::to_string(end) +
           ", past the end of the file (" + std::to_string(b.size()) + " bytes)");
  }
  const std::uint64_t padded = f.tensors.empty() ? data : data + expected;
  if (b.size() > std::max(end, padded)) {
    c.fail(std::to_string(b.size() - std::max(end, padded)) +
           " bytes follow the last tensor's data and padding");
  }
  // Padding is zeros, as every writer writes it: the header's up to the data, and each tensor's up
  // to the next.
  const auto zeros = [&](std::uint64_t from, std::uint64_t to, const std::string& what) {
    to = std::min<std::uint64_t>(to, b.size());
    for (std::uint64_t k = from; k < to; ++k) {
      if (b[k] != '\0') {
        throw FormatError(source + ": byte " + std::to_string(k) + " of the padding " + what +
                          " is not zero");
      }
    }
  };
  zeros(c.at(), data, "before the tensors' data");
  for (std::size_t k = 0; k < f.tensors.size(); ++k) {
    zeros(data + offsets[k] + sizes[k],
          k + 1 < f.tensors.size() ? data + offsets[k + 1] : data + expected,
          "after tensor " + f.tensors[k].name);
  }
  for (std::size_t k = 0; k < f.tensors.size(); ++k) {
    Tensor& t = f.tensors[k];
    const auto* p = reinterpret_cast<const std::uint8_t*>(b.data() + data + offsets[k]);
    const auto shape = quant::block_shape(t.type);
    std::string why;
    const auto blocks =
        static_cast<std::int64_t>(sizes[k] / static_cast<std::uint64_t>(shape.bytes));
    const std::int64_t bad = quant::first_invalid_block(t.type, p, blocks, why);
    if (bad >= 0) {
      throw FormatError(source + ": tensor " + t.name + ", block " + std::to_string(bad) +
                        (shape.values > 1
                             ? " (values " + std::to_string(bad * shape.values) + " to " +
                                   std::to_string((bad + 1) * shape.values - 1) + ")"
                             : "") +
                        ": " + why);
    }
    if (view) {
      t.mapped = p;
      t.mapped_size = sizes[k];
    } else {
      t.bytes.assign(p, p + sizes[k]);
    }
  }
  return f;
}

}  // namespace

const char* to_string(ValueType t) {
  static constexpr const char* kNames[] = {"UINT8",  "INT8",    "UINT16", "INT16",  "UINT32",
                                           "INT32",  "FLOAT32", "BOOL",   "STRING", "ARRAY",
                                           "UINT64", "INT64",   "FLOAT64"};
  const auto i = static_cast<std::uint32_t>(t);
  return i < std::size(kNames) ? kNames[i] : "?";
}

Value Value::of_u32(std::uint32_t v) {
  Value x;
  x.type = ValueType::u32;
  x.u = v;
  return x;
}
Value Value::of_u64(std::uint64_t v) {
  Value x;
  x.type = ValueType::u64;
  x.u = v;
  return x;
}
Value Value::of_i32(std::int32_t v) {
  Value x;
  x.type = ValueType::i32;
  x.i = v;
  return x;
}
Value Value::of_f32(float v) {
  Value x;
  x.type = ValueType::f32;
  x.f = v;
  x.u = std::bit_cast<std::uint32_t>(v);
  return x;
}
Value Value::of_bool(bool v) {
  Value x;
  x.type = ValueType::boolean;
  x.i = v ? 1 : 0;
  return x;
}
Value Value::of_string(std::string v) {
  Value x;
  x.type = ValueType::string;
  x.s = std::move(v);
  return x;
}
Value Value::of_strings(const std::vector<std::string>& v) {
  Value x;
  x.type = ValueType::array;
  x.item_type = ValueType::string;
  for (const auto& s : v) x.items.push_back(of_string(s));
  return x;
}

bool Value::operator==(const Value& o) const {
  if (type != o.type) return false;
  switch (type) {
    case ValueType::string:
      return s == o.s;
    case ValueType::array:
      return item_type == o.item_type && items == o.items;
    default:
      return u == o.u && i == o.i;
  }
}

std::int64_t Tensor::numel() const {
  std::int64_t n = 1;
  for (const auto d : dims) n *= d;
  return n;
}

std::string Tensor::shape_str() const {
  std::string s = "[";
  for (std::size_t k = dims.size(); k-- > 0;) {
    s += std::to_string(dims[k]);
    if (k > 0) s += ", ";
  }
  return s + "]";
}

std::vector<float> Tensor::values() const {
  const auto shape = quant::block_shape(type);
  const auto bytes_ = data();
  std::vector<float> out(static_cast<std::size_t>(numel()));
  const std::size_t blocks = out.size() / static_cast<std::size_t>(shape.values);
  for (std::size_t k = 0; k < blocks; ++k) {
    quant::dequantize_block(type, bytes_.data() + k * static_cast<std::size_t>(shape.bytes),
                            out.data() + k * static_cast<std::size_t>(shape.values));
  }
  return out;
}

const Value* File::meta(const std::string& key) const {
  for (const auto& [k, v] : metadata)
    if (k == key) return &v;
  return nullptr;
}

const Tensor* File::find(const std::string& name) const {
  for (const auto& t : tensors)
    if (t.name == name) return &t;
  return nullptr;
}

std::uint64_t File::alignment() const {
  const Value* a = meta("general.alignment");
  return a && a->type == ValueType::u32 && a->u > 0 ? a->u : kDefaultAlignment;
}

void File::add(const std::string& name, quant::GgmlType type, std::vector<std::int64_t> dims,
               std::vector<std::uint8_t> bytes) {
  if (name.empty() || name.size() >= kMaxName) {
    throw FormatError("GGUF tensor name \"" + name + "\" must be 1 to " +
                      std::to_string(kMaxName - 1) + " bytes");
  }
  if (find(name)) throw FormatError("GGUF tensor " + name + " is added twice");
  std::uint64_t size = 0;
  if (const auto why = shape_error(type, dims, size); !why.empty()) {
    throw ShapeError("GGUF tensor " + name + " " + why);
  }
  if (bytes.size() != size) {
    throw FormatError("GGUF tensor " + name + " of " + quant::to_string(type) + " needs " +
                      std::to_string(size) + " bytes, got " + std::to_string(bytes.size()));
  }
  Tensor t;
  t.name = name;
  t.type = type;
  t.dims = std::move(dims);
  t.bytes = std::move(bytes);
  tensors.push_back(std::move(t));
}

void File::set(const std::string& key, Value v) {
  for (auto& [k, old] : metadata) {
    if (k == key) {
      old = std::move(v);
      return;
    }
  }
  metadata.emplace_back(key, std::move(v));
}

File parse(std::string_view bytes, const std::string& source, const Limits& limits) {
  return parse_bytes(bytes, source, limits, /*view=*/false);
}

File map(const std::string& path, const Limits& limits) {
  MappedFile m = map_readonly(path, limits.max_file_bytes);
  File f = parse_bytes(m.bytes, path, limits, /*view=*/true);
  f.backing = std::move(m.backing);
  return f;
}

File read(const std::string& path, const Limits& limits) {
  const MappedFile m = map_readonly(path, limits.max_file_bytes);
  return parse_bytes(m.bytes, path, limits, /*view=*/false);
}

std::string serialize(const File& file) {
  std::string out;
  put(out, kMagic);
  put(out, file.version);
  put<std::uint64_t>(out, file.tensors.size());
  put<std::uint64_t>(out, file.metadata.size());
  for (const auto& [k, v] : file.metadata) {
    put_string(out, k);
    put(out, static_cast<std::uint32_t>(v.type));
    write_value(out, v);
  }
  const std::uint64_t align = file.alignment();
  std::uint64_t offset = 0;
  for (const auto& t : file.tensors) {
    put_string(out, t.name);
    put<std::uint32_t>(out, static_cast<std::uint32_t>(t.dims.size()));
    for (const auto d : t.dims) put<std::uint64_t>(out, static_cast<std::uint64_t>(d));
    put(out, static_cast<std::uint32_t>(t.type));
    put(out, offset);
    offset = round_up(offset + t.data().size(), align);
  }
  out.resize(round_up(out.size(), align), '\0');
  for (const auto& t : file.tensors) {
    const auto d = t.data();
    put_bytes(out, d.data(), d.size());
    out.resize(round_up(out.size(), align), '\0');
  }
  return out;
}

void write(const File& file, const std::string& path, bool overwrite) {
  write_file_atomic(path, serialize(file), overwrite);
}

}  // namespace teo::gguf
