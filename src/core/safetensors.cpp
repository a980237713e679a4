#include "teo/safetensors.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>

#include <nlohmann/json.hpp>

#include "teo/files.hpp"
#include "teo/precision.hpp"

namespace teo::safetensors {

namespace {

using nlohmann::json;

[[noreturn]] void fail(const std::string& source, const std::string& what) {
  throw FormatError(source + ": not a valid safetensors file: " + what);
}

constexpr DType kDTypes[] = {DType::F32, DType::F64,     DType::I64,     DType::U8,  DType::BF16,
                             DType::F16, DType::F8_E4M3, DType::F8_E5M2, DType::I32, DType::I8};

bool parse_dtype(const std::string& s, DType& d) {
  for (DType t : kDTypes) {
    if (s == dtype_name(t)) {
      d = t;
      return true;
    }
  }
  return false;
}

// The value of an OCP float8 E4M3 ("fn") byte: bias 7, subnormals, no infinities, NaN at
// S.1111.111.
double e4m3_value(unsigned char b) {
  const double sign = (b & 0x80) ? -1.0 : 1.0;
  const int e = (b >> 3) & 0xF, m = b & 0x7;
  if (e == 15 && m == 7) return std::numeric_limits<double>::quiet_NaN();
  if (e == 0) return sign * std::ldexp(m, -9);
  return sign * std::ldexp(8 + m, e - 10);
}

std::uint64_t read_u64_le(const unsigned char* p) {
  std::uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// A non-negative JSON integer that fits in int64, or FormatError naming `what`.
std::int64_t json_size(const json& v, const std::string& source, const std::string& what) {
  if (v.is_number_unsigned()) {
    const auto u = v.get<std::uint64_t>();
    if (u > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
      fail(source, what + " " + std::to_string(u) + " is too large");
    }
    return static_cast<std::int64_t>(u);
  }
  if (v.is_number_integer()) fail(source, what + " is negative: " + v.dump());
  fail(source, what + " is not a non-negative integer: " + v.dump());
}

struct Parsed {
  std::string name;
  DType dtype;
  std::vector<std::int64_t> shape;
  std::int64_t begin, end;
};

}  // namespace

const char* dtype_name(DType d) {
  switch (d) {
    case DType::F32:
      return "F32";
    case DType::F64:
      return "F64";
    case DType::I64:
      return "I64";
    case DType::I32:
      return "I32";
    case DType::U8:
      return "U8";
    case DType::I8:
      return "I8";
    case DType::BF16:
      return "BF16";
    case DType::F16:
      return "F16";
    case DType::F8_E4M3:
      return "F8_E4M3";
    case DType::F8_E5M2:
      return "F8_E5M2";
  }
  return "?";
}

std::size_t dtype_size(DType d) {
  switch (d) {
    case DType::F32:
    case DType::I32:
      return 4;
    case DType::F64:
    case DType::I64:
      return 8;
    case DType::BF16:
    case DType::F16:
      return 2;
    case DType::U8:
    case DType::I8:
    case DType::F8_E4M3:
    case DType::F8_E5M2:
      return 1;
  }
  return 1;
}

bool is_float(DType d) {
  return d != DType::I64 && d != DType::I32 && d != DType::U8 && d != DType::I8;
}

std::vector<double> Tensor::float_values() const {
  const auto n = static_cast<std::size_t>(numel());
  const unsigned char* b = data().data();
  switch (dtype) {
    case DType::F64:
      return values<double>();
    case DType::F32: {
      const auto v = values<float>();
      return {v.begin(), v.end()};
    }
    case DType::BF16:
    case DType::F16: {
      const Precision p = dtype == DType::BF16 ? Precision::bf16 : Precision::fp16;
      std::vector<double> out(n);
      for (std::size_t i = 0; i < n; ++i)
        out[i] = from_bits(p, static_cast<std::uint16_t>(b[2 * i] | b[2 * i + 1] << 8));
      return out;
    }
    case DType::F8_E5M2: {
      // E5M2 is the top byte of an fp16
      std::vector<double> out(n);
      for (std::size_t i = 0; i < n; ++i)
        out[i] = from_bits(Precision::fp16, static_cast<std::uint16_t>(b[i] << 8));
      return out;
    }
    case DType::F8_E4M3: {
      std::vector<double> out(n);
      for (std::size_t i = 0; i < n; ++i) out[i] = e4m3_value(b[i]);
      return out;
    }
    case DType::I64:
    case DType::I32:
    case DType::U8:
    case DType::I8:
      break;
  }
  throw FormatError("tensor " + name + " has dtype " + dtype_name(dtype) + ", not a float type");
}

std::vector<std::int64_t> Tensor::int_values() const {
  if (dtype == DType::I32) {
    const auto v = values<std::int32_t>();
    return {v.begin(), v.end()};
  }
  if (dtype == DType::I8) {
    const auto b = data();
    std::vector<std::int64_t> out(b.size());
    for (std::size_t i = 0; i < b.size(); ++i)
      out[i] = static_cast<int>(static_cast<std::int8_t>(b[i]));
    return out;
  }
  return values<std::int64_t>();
}

std::int64_t Tensor::numel() const {
  std::int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

std::string Tensor::shape_str() const {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

const Tensor* File::find(const std::string& name) const {
  for (const auto& t : tensors) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

const std::string* File::meta(const std::string& key) const {
  for (const auto& [k, v] : metadata) {
    if (k == key) return &v;
  }
  return nullptr;
}

void File::add(const std::string& name, DType dtype, std::vector<std::int64_t> shape,
               const void* data, std::size_t bytes) {
  if (name.empty() || name == "__metadata__") {
    throw FormatError("safetensors: invalid tensor name '" + name + "'");
  }
  if (find(name)) throw FormatError("safetensors: duplicate tensor name " + name);
  index_t n = 1;
  for (auto d : shape) n = checked_mul(n, d, "safetensors tensor " + name);
  const index_t expect = checked_mul(n, static_cast<index_t>(dtype_size(dtype)),
                                     "safetensors tensor " + name + " bytes");
  if (static_cast<std::uint64_t>(expect) != bytes) {
    throw FormatError("safetensors: tensor " + name + " has " + std::to_string(bytes) +
                      " bytes, its shape needs " + std::to_string(expect));
  }
  Tensor t;
  t.name = name;
  t.dtype = dtype;
  t.shape = std::move(shape);
  const auto* p = static_cast<const unsigned char*>(data);
  t.bytes.assign(p, p + bytes);
  tensors.push_back(std::move(t));
}

namespace {

// What a file that is not safetensors is, from its first bytes, or "" when it is not recognised.
std::string other_format(std::string_view b) {
  const auto starts = [&](std::string_view magic) { return b.substr(0, magic.size()) == magic; };
  if (starts("PK\x03\x04") || starts("PK\x05\x06"))
    return "a zip archive (numpy's .npz, or torch.save's .pt or .pth)";
  if (starts("\x93NUMPY")) return "a numpy .npy array";
  if (starts("\x80")) return "a Python pickle (torch.save's legacy format, or pickle.dump)";
  if (starts("\x89HDF")) return "an HDF5 file (Keras .h5)";
  if (starts("GGUF")) return "a GGUF file";
  if (starts("{")) return "JSON text";
  return "";
}

// parse(), with the tensors' bytes copied, or (view) pointing into `bytes`.
File parse_bytes(std::string_view bytes, const std::string& source, const Limits& limits,
                 bool view) {
  // A safetensors file is an 8-byte header length, then a JSON object: '{' (or a space of
  // padding) at byte 8. A file of another format is named as such.
  if (const auto other = other_format(bytes);
      !other.empty() && (bytes.size() < 9 || (bytes[8] != '{' && bytes[8] != ' '))) {
    throw FormatError(source + ": not a safetensors file: it is " + other +
                      ". Write candidates with teo.golden.save or safetensors' save_file");
  }
  if (bytes.size() < 8) {
    fail(source, "the file has " + std::to_string(bytes.size()) +
                     " bytes, fewer than the 8-byte header length");
  }
  const auto* base = reinterpret_cast<const unsigned char*>(bytes.data());
  const std::uint64_t n = read_u64_le(base);
  if (n > limits.max_header_bytes) {
    fail(source, "the header length " + std::to_string(n) + " exceeds the limit of " +
                     std::to_string(limits.max_header_bytes) + " bytes");
  }
  if (n > bytes.size() - 8) {
    fail(source, "the header length " + std::to_string(n) + " runs past the end of the file (" +
                     std::to_string(bytes.size()) + " bytes)");
  }
  if (n < 2) fail(source, "the header length " + std::to_string(n) + " is too short for JSON");

  // Duplicate keys are an error at every level (nlohmann::json would keep the last silently).
  std::vector<std::set<std::string>> keys;
  std::string duplicate;
  const auto callback = [&](int, json::parse_event_t ev, json& parsed) {
    if (ev == json::parse_event_t::object_start)
      keys.emplace_back();
    else if (ev == json::parse_event_t::object_end)
      keys.pop_back();
    else if (ev == json::parse_event_t::key && !keys.empty()) {
      const auto k = parsed.get<std::string>();
      if (!keys.back().insert(k).second && duplicate.empty()) duplicate = k;
    }
    return true;
  };
  json header;
  try {
    header = json::parse(bytes.substr(8, n), callback);
  } catch (const json::exception& e) {
    fail(source, std::string("the header is not valid JSON (") + e.what() + ")");
  }
  if (!duplicate.empty()) fail(source, "the header repeats the key '" + duplicate + "'");
  if (!header.is_object()) fail(source, "the header is not a JSON object");

  File file;
  std::vector<Parsed> entries;
  for (const auto& [name, v] : header.items()) {
    if (name == "__metadata__") {
      if (!v.is_object()) fail(source, "__metadata__ is not an object");
      for (const auto& [k, mv] : v.items()) {
        if (!mv.is_string()) fail(source, "__metadata__ value for '" + k + "' is not a string");
        file.metadata.emplace_back(k, mv.get<std::string>());
      }
      continue;
    }
    const std::string what = "tensor '" + name + "'";
    if (name.empty()) fail(source, "a tensor has an empty name");
    if (!v.is_object()) fail(source, what + " is not an object");
    for (const auto& [k, unused] : v.items()) {
      (void)unused;
      if (k != "dtype" && k != "shape" && k != "data_offsets") {
        fail(source, what + " has the unknown key '" + k + "'");
      }
    }
    if (!v.contains("dtype") || !v.contains("shape") || !v.contains("data_offsets")) {
      fail(source, what + " needs dtype, shape and data_offsets");
    }
    Parsed e;
    e.name = name;
    if (!v["dtype"].is_string()) fail(source, what + " has a dtype that is not a string");
    if (!parse_dtype(v["dtype"].get<std::string>(), e.dtype)) {
      fail(source, what + " has the unsupported dtype '" + v["dtype"].get<std::string>() +
                       "' (teo reads F32, F64, BF16, F16, F8_E4M3, F8_E5M2, I64, I32, I8 and U8)");
    }
    const json& shape = v["shape"];
    if (!shape.is_array()) fail(source, what + " has a shape that is not an array");
    if (shape.size() > 64) fail(source, what + " has more than 64 dimensions");
    std::int64_t numel = 1;
    for (const auto& d : shape) {
      e.shape.push_back(json_size(d, source, what + " dimension"));
      if (__builtin_mul_overflow(numel, e.shape.back(), &numel)) {
        fail(source, what + " has an element count that overflows 64 bits");
      }
    }
    const json& off = v["data_offsets"];
    if (!off.is_array() || off.size() != 2) {
      fail(source, what + " has data_offsets that are not [begin, end]");
    }
    e.begin = json_size(off[0], source, what + " begin offset");
    e.end = json_size(off[1], source, what + " end offset");
    if (e.end < e.begin) fail(source, what + " ends before it begins");
    std::int64_t size = 0;
    if (__builtin_mul_overflow(numel, static_cast<std::int64_t>(dtype_size(e.dtype)), &size)) {
      fail(source, what + " has a byte size that overflows 64 bits");
    }
    if (size != e.end - e.begin) {
      fail(source, what + " has " + std::to_string(e.end - e.begin) +
                       " bytes, but its shape and dtype need " + std::to_string(size));
    }
    entries.push_back(std::move(e));
  }

  std::stable_sort(entries.begin(), entries.end(), [](const Parsed& a, const Parsed& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  std::int64_t at = 0;
  for (const auto& e : entries) {
    if (e.begin > at) {
      fail(source, "a hole in the data before tensor '" + e.name + "' (offset " +
                       std::to_string(at) + " to " + std::to_string(e.begin) + ")");
    }
    if (e.begin < at) fail(source, "tensor '" + e.name + "' overlaps the tensor before it");
    at = e.end;
  }
  const std::uint64_t data_size = bytes.size() - 8 - n;
  if (static_cast<std::uint64_t>(at) != data_size) {
    fail(source, "the file is " + std::to_string(bytes.size()) + " bytes, but the header says " +
                     std::to_string(8 + n + static_cast<std::uint64_t>(at)));
  }

  const auto* data = base + 8 + n;
  for (auto& e : entries) {
    Tensor t;
    t.name = std::move(e.name);
    t.dtype = e.dtype;
    t.shape = std::move(e.shape);
    if (view) {
      t.mapped = data + e.begin;
      t.mapped_size = static_cast<std::size_t>(e.end - e.begin);
    } else {
      t.bytes.assign(data + e.begin, data + e.end);
    }
    file.tensors.push_back(std::move(t));
  }
  return file;
}

// The size of regular file `path`, within the limit: FileError or FormatError otherwise.
std::uint64_t checked_file_size(const std::string& path, const Limits& limits) {
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);
  if (ec || !std::filesystem::exists(status)) throw FileError(path + ": no such file");
  if (!std::filesystem::is_regular_file(status)) throw FileError(path + ": not a regular file");
  const auto size = std::filesystem::file_size(path, ec);
  if (ec) throw FileError(path + ": cannot read its size: " + ec.message());
  if (size > limits.max_file_bytes) {
    throw FormatError(path + ": the file is " + std::to_string(size) +
                      " bytes, more than the limit of " + std::to_string(limits.max_file_bytes));
  }
  return size;
}

}  // namespace

File parse(std::string_view bytes, const std::string& source, const Limits& limits) {
  return parse_bytes(bytes, source, limits, /*view=*/false);
}

File map(const std::string& path, const Limits& limits) {
  MappedFile m = map_readonly(path, limits.max_file_bytes);
  File f = parse_bytes(m.bytes, path, limits, /*view=*/true);
  f.backing = std::move(m.backing);
  return f;
}

void release(const Tensor& t) {
  if (!t.mapped || t.mapped_size == 0) return;
  const auto page = static_cast<std::uintptr_t>(::sysconf(_SC_PAGESIZE));
  // The page-aligned range around the tensor, as offsets from its first byte.
  const std::uintptr_t at = reinterpret_cast<std::uintptr_t>(t.mapped);
  const std::uintptr_t lead = at % page;
  const std::size_t span = (lead + t.mapped_size + page - 1) / page * page;
  auto* first = const_cast<unsigned char*>(t.mapped) - lead;
  // Advice only: a failure leaves the pages resident, which is not an error.
  ::madvise(first, span, MADV_DONTNEED);
}

File read(const std::string& path, const Limits& limits) {
  const std::uint64_t size = checked_file_size(path, limits);
  std::ifstream in(path, std::ios::binary);
  if (!in) throw FileError(path + ": cannot open for reading");
  std::string bytes(static_cast<std::size_t>(size), '\0');
  in.read(bytes.data(), static_cast<std::streamsize>(size));
  if (static_cast<std::uint64_t>(in.gcount()) != size) throw FileError(path + ": short read");
  return parse(bytes, path, limits);
}

std::uint64_t Entry::byte_size() const {
  index_t n = 1;
  for (auto d : shape) n = checked_mul(n, d, "safetensors tensor " + name);
  return static_cast<std::uint64_t>(
      checked_mul(n, static_cast<index_t>(dtype_size(dtype)), "safetensors tensor " + name));
}

std::string header_bytes(const std::vector<std::pair<std::string, std::string>>& metadata,
                         const std::vector<Entry>& entries) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    auto meta = nlohmann::ordered_json::object();
    for (const auto& [k, v] : metadata) meta[k] = v;
    header["__metadata__"] = std::move(meta);
  }
  std::uint64_t at = 0;
  for (const auto& t : entries) {
    const std::uint64_t size = t.byte_size();
    nlohmann::ordered_json e = nlohmann::ordered_json::object();
    e["dtype"] = dtype_name(t.dtype);
    e["shape"] = t.shape;
    e["data_offsets"] = {at, at + size};
    header[t.name] = std::move(e);
    at += size;
  }
  std::string h = header.dump();
  h.append((8 - h.size() % 8) % 8, ' ');
  std::string out;
  const std::uint64_t n = h.size();
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((n >> (8 * i)) & 0xff));
  return out + h;
}

std::string serialize(const File& file) {
  std::vector<Entry> entries;
  std::uint64_t total = 0;
  for (const auto& t : file.tensors) {
    entries.push_back({t.name, t.dtype, t.shape});
    total += t.data().size();
  }
  std::string out = header_bytes(file.metadata, entries);
  out.reserve(out.size() + total);
  for (const auto& t : file.tensors) {
    const auto b = t.data();
    out.append(reinterpret_cast<const char*>(b.data()), b.size());
  }
  return out;
}

Writer::Writer(std::string path, std::vector<std::pair<std::string, std::string>> metadata,
               std::vector<Entry> entries, bool overwrite)
    : path_(std::move(path)),
      overwrite_(overwrite),
      metadata_(std::move(metadata)),
      entries_(std::move(entries)) {
  for (std::size_t i = 0; i < entries_.size(); ++i) {
    const std::string& name = entries_[i].name;
    if (name.empty() || name == "__metadata__") {
      throw FormatError("safetensors: invalid tensor name '" + name + "'");
    }
    if (!index_.emplace(name, i).second) {
      throw FormatError("safetensors: duplicate tensor name " + name);
    }
  }
  const std::string header = header_bytes(metadata_, entries_);
  header_size_ = header.size();
  for (const auto& e : entries_) {
    offset_.push_back(header_size_ + data_size_);
    data_size_ += e.byte_size();
  }
  written_.assign(entries_.size(), false);
  std::tie(fd_, tmp_) = open_temp_beside(path_, overwrite_);
  if (!write_all_at(fd_, header.data(), header.size(), 0) ||
      ::ftruncate(fd_, static_cast<off_t>(header_size_ + data_size_)) != 0) {
    // A constructor that throws runs no destructor: the temporary file goes here.
    const std::string why = std::strerror(errno);
    ::close(fd_);
    ::unlink(tmp_.c_str());
    throw FileError(path_ + ": write failed: " + why);
  }
}

Writer::~Writer() {
  if (fd_ >= 0) ::close(fd_);
  if (!tmp_.empty()) ::unlink(tmp_.c_str());
}

void Writer::write(const std::string& name, const void* data, std::size_t bytes) {
  const auto it = index_.find(name);
  if (it == index_.end()) throw FormatError("safetensors: " + name + " is not in the header");
  const std::size_t i = it->second;
  if (written_[i]) throw FormatError("safetensors: " + name + " is written twice");
  if (bytes != entries_[i].byte_size()) {
    throw FormatError("safetensors: tensor " + name + " has " + std::to_string(bytes) +
                      " bytes, its shape needs " + std::to_string(entries_[i].byte_size()));
  }
  if (!write_all_at(fd_, data, bytes, offset_[i])) {
    throw FileError(path_ + ": write failed: " + std::strerror(errno));
  }
  written_[i] = true;
}

namespace {

std::string first_unwritten(const std::vector<Entry>& entries, const std::vector<bool>& written) {
  for (std::size_t i = 0; i < entries.size(); ++i)
    if (!written[i]) return entries[i].name;
  return "";
}

}  // namespace

File Writer::contents() const {
  if (const std::string missing = first_unwritten(entries_, written_); !missing.empty()) {
    throw FormatError("safetensors: " + missing + " has not been written");
  }
  return map(tmp_, {.max_header_bytes = Limits{}.max_header_bytes,
                    .max_file_bytes = header_size_ + data_size_});
}

void Writer::set_metadata(std::vector<std::pair<std::string, std::string>> metadata) {
  metadata_ = std::move(metadata);
}

std::uint64_t Writer::commit() {
  if (const std::string missing = first_unwritten(entries_, written_); !missing.empty()) {
    throw FormatError("safetensors: " + missing + " has not been written");
  }
  const std::string header = header_bytes(metadata_, entries_);
  if (header.size() == header_size_) {
    if (!write_all_at(fd_, header.data(), header.size(), 0)) {
      throw FileError(path_ + ": write failed: " + std::strerror(errno));
    }
  } else {
    // The metadata changed the header's length: the data moves, through a second temporary file.
    // The old one stays the Writer's until the move is complete, so a failure leaves one file for
    // the destructor and the Writer as it was.
    std::vector<char> buf(std::size_t{1} << 24);
    auto [fd, tmp] = open_temp_beside(path_, /*overwrite=*/true);
    int failure = write_all_at(fd, header.data(), header.size(), 0) ? 0 : errno;
    for (std::uint64_t at = 0; failure == 0 && at < data_size_;) {
      const auto n = static_cast<std::size_t>(std::min<std::uint64_t>(buf.size(), data_size_ - at));
      const ssize_t r = ::pread(fd_, buf.data(), n, static_cast<off_t>(header_size_ + at));
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) {
        failure = r == 0 ? EIO : errno;  // the file is shorter than its header says
      } else if (!write_all_at(fd, buf.data(), static_cast<std::size_t>(r), header.size() + at)) {
        failure = errno;
      }
      at += r > 0 ? static_cast<std::uint64_t>(r) : 0;
    }
    if (failure != 0) {
      ::close(fd);
      ::unlink(tmp.c_str());
      throw FileError(path_ + ": write failed: " + std::strerror(failure));
    }
    ::close(fd_);
    ::unlink(tmp_.c_str());
    fd_ = fd;
    tmp_ = tmp;
    for (auto& o : offset_) o = o - header_size_ + header.size();
    header_size_ = header.size();
  }
  const int fd = fd_;
  const std::string tmp = tmp_;
  fd_ = -1;
  tmp_.clear();
  commit_temp(fd, tmp, path_, overwrite_);
  return header_size_ + data_size_;
}

}  // namespace teo::safetensors
