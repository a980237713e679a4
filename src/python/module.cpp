// teo._teo: the compiled half of the Python module. It converts arrays and dicts at the edge and
// calls the library; it holds no numerics. The pure-Python half (src/python/teo/) gives the API
// its shape: teo.run, teo.ops, teo.golden, teo.testing.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "golden/golden_internal.hpp"
#include "teo/backend.hpp"
#include "teo/errors.hpp"
#include "teo/files.hpp"
#include "teo/fp8.hpp"
#include "teo/generate.hpp"
#include "teo/golden.hpp"
#include "teo/golden_ops.hpp"
#include "teo/model.hpp"
#include "teo/precision.hpp"
#include "teo/safetensors.hpp"
#include "teo/suggest.hpp"

namespace py = pybind11;
using nlohmann::json;

namespace {

// Runs fn() with the GIL released, under one process-wide lock, with this call's backend and
// thread count (restored afterwards). The backend, ISA and thread count are process-wide
// settings, so two Python threads asking for different ones take turns.
template <class F>
auto compute(F&& fn, const std::optional<std::string>& backend = std::nullopt,
             std::optional<int> threads = std::nullopt) {
  static std::mutex m;
  py::gil_scoped_release release;
  const std::lock_guard lock(m);
  const teo::ScopedSettings keep;
  if (backend) teo::set_backend(teo::parse_backend(*backend, "backend"));
  if (threads) teo::set_num_threads(*threads);
  return fn();
}

std::string to_text(const py::handle& obj) {
  return py::module_::import("json").attr("dumps")(obj).cast<std::string>();
}

py::object from_text(const std::string& text) {
  return py::module_::import("json").attr("loads")(text);
}

// ---- tensors across the edge: (name, dtype, shape, bytes) ------------------------------------

using Wire = std::tuple<std::string, std::string, std::vector<std::int64_t>, py::bytes>;

teo::safetensors::DType dtype_named(const std::string& name, const std::string& tensor) {
  using teo::safetensors::DType;
  for (DType d : {DType::F32, DType::F64, DType::I64, DType::I32, DType::I8, DType::U8, DType::BF16,
                  DType::F16, DType::F8_E4M3, DType::F8_E5M2}) {
    if (name == teo::safetensors::dtype_name(d)) return d;
  }
  throw teo::ConfigError("tensor " + tensor + " has the unsupported dtype " + name);
}

teo::safetensors::File file_of(const std::vector<std::pair<std::string, std::string>>& metadata,
                               const std::vector<Wire>& tensors) {
  teo::safetensors::File f;
  f.metadata = metadata;
  for (const auto& [name, dtype, shape, bytes] : tensors) {
    const std::string_view b = bytes;
    f.add(name, dtype_named(dtype, name), shape, b.data(), b.size());
  }
  return f;
}

std::vector<Wire> wire_of(const teo::safetensors::File& f) {
  std::vector<Wire> out;
  out.reserve(f.tensors.size());
  for (const auto& t : f.tensors) {
    out.emplace_back(t.name, teo::safetensors::dtype_name(t.dtype), t.shape,
                     py::bytes(reinterpret_cast<const char*>(t.data().data()), t.data().size()));
  }
  return out;
}

// ---- arrays into the library -----------------------------------------------------------------

template <class Real>
void fill_from(teo::Tensor<Real>& t, const py::handle& obj, const std::string& name) {
  if (!py::isinstance<py::array>(obj)) {
    throw teo::ConfigError(name + " must be a numpy array");
  }
  const auto arr = py::reinterpret_borrow<py::array>(obj);
  if (!arr.dtype().is(py::dtype::of<Real>())) {
    throw teo::ConfigError(name + " has dtype " + py::str(arr.dtype()).cast<std::string>() +
                           ", expected " + (sizeof(Real) == 4 ? "float32" : "float64"));
  }
  std::vector<teo::index_t> shape(arr.shape(), arr.shape() + arr.ndim());
  if (teo::Shape(shape) != t.shape()) {
    throw teo::ShapeError(name + " has shape " + teo::Shape(shape).str() + ", expected " +
                          t.shape().str());
  }
  // A C-contiguous copy of any layout: strided views are accepted.
  const auto c = py::array_t<Real, py::array::c_style>::ensure(arr);
  if (t.numel() > 0)
    std::memcpy(t.data(), c.data(), static_cast<std::size_t>(t.numel()) * sizeof(Real));
}

std::vector<std::int64_t> ints_from(const py::dict& d, const char* key) {
  if (!d.contains(key)) throw teo::ConfigError(std::string("the batch has no \"") + key + "\"");
  const py::object v = d[key];
  const auto arr = py::array::ensure(v);
  if (!arr || arr.dtype().kind() != 'i') {
    throw teo::ConfigError(std::string("batch[\"") + key + "\"] must be an integer array");
  }
  const auto c = py::array_t<std::int64_t, py::array::c_style | py::array::forcecast>::ensure(arr);
  return {c.data(), c.data() + c.size()};
}

template <class Real>
teo::Params<Real> params_from(const teo::ModelConfig& cfg, const py::dict& d) {
  auto p = teo::Params<Real>::zeros(cfg);
  std::size_t used = 0;
  p.visit([&](const std::string& name, teo::Tensor<Real>& t) {
    if (!d.contains(name)) throw teo::ConfigError("params has no \"" + name + "\"");
    fill_from(t, d[name.c_str()], "params[\"" + name + "\"]");
    ++used;
  });
  if (used != d.size()) {
    for (const auto& [k, v] : d) {
      bool known = false;
      const std::string key = py::str(k).cast<std::string>();
      p.visit([&](const std::string& name, const teo::Tensor<Real>&) { known |= name == key; });
      if (!known) throw teo::ConfigError("params has the unknown key \"" + key + "\"");
    }
  }
  return p;
}

// An encoder_decoder's batch: {"src_tokens" (B, S), "src_lengths", "tgt_tokens" (B, T),
// "tgt_lengths"}, the golden's input.* names without the prefix.
teo::Batch seq2seq_batch_from(const py::dict& d) {
  teo::Batch b;
  for (const char* key : {"tokens", "lengths", "labels"}) {
    if (d.contains(key)) {
      throw teo::ConfigError(std::string("the batch has \"") + key +
                             "\", but an encoder_decoder's is {\"src_tokens\", \"src_lengths\", "
                             "\"tgt_tokens\", \"tgt_lengths\"}");
    }
  }
  const auto shape_of = [&](const char* key) {
    const auto a = py::array::ensure(d.contains(key) ? py::object(d[key]) : py::none());
    if (!a || a.ndim() != 2)
      throw teo::ShapeError(std::string("batch[\"") + key +
                            "\"] must be a (batch, length) integer array");
    return std::pair<teo::index_t, teo::index_t>{a.shape(0), a.shape(1)};
  };
  const auto [B, S] = shape_of("src_tokens");
  const auto [Bt, T] = shape_of("tgt_tokens");
  if (Bt != B) {
    throw teo::ShapeError("batch[\"tgt_tokens\"] has " + std::to_string(Bt) +
                          " sequences, batch[\"src_tokens\"] " + std::to_string(B));
  }
  b.batch = B;
  b.seq_len = S;
  b.tgt_len = T;
  b.tokens = ints_from(d, "src_tokens");
  b.lengths = ints_from(d, "src_lengths");
  b.tgt_tokens = ints_from(d, "tgt_tokens");
  b.tgt_lengths = ints_from(d, "tgt_lengths");
  return b;
}

// input "patches": {"pixels" (B, Ch, Img, Img) floats, "labels" (B), "lengths" (optional: every
// length is 1 + patches)}.
teo::Batch patches_batch_from(const teo::ModelConfig& cfg, const py::dict& d) {
  for (const char* key : {"tokens", "token_types"}) {
    if (d.contains(key)) {
      throw teo::ConfigError(std::string("the batch has \"") + key +
                             "\", but input \"patches\" reads images: {\"pixels\", \"labels\"}");
    }
  }
  const auto arr = py::array::ensure(d.contains("pixels") ? py::object(d["pixels"]) : py::none());
  if (!arr || arr.ndim() != 4 ||
      (arr.dtype().kind() != 'f' && arr.dtype().kind() != 'i' && arr.dtype().kind() != 'u')) {
    throw teo::ShapeError(
        "batch[\"pixels\"] must be a (batch, channels, image_size, image_size) float (or "
        "integer) array");
  }
  teo::Batch b;
  b.batch = arr.shape(0);
  b.seq_len = 1 + cfg.patches();
  const auto px = py::array_t<double, py::array::c_style | py::array::forcecast>::ensure(arr);
  for (int k = 1; k < 4; ++k) {
    const teo::index_t want = k == 1 ? cfg.embeddings.channels : cfg.embeddings.image_size;
    if (px.shape(k) != want) {
      throw teo::ShapeError("batch[\"pixels\"] is (" + std::to_string(px.shape(0)) + ", " +
                            std::to_string(px.shape(1)) + ", " + std::to_string(px.shape(2)) +
                            ", " + std::to_string(px.shape(3)) + "), expected (batch, " +
                            std::to_string(cfg.embeddings.channels) + ", " +
                            std::to_string(cfg.embeddings.image_size) + ", " +
                            std::to_string(cfg.embeddings.image_size) + ")");
    }
  }
  b.pixels.assign(px.data(), px.data() + px.size());
  b.lengths = d.contains("lengths")
                  ? ints_from(d, "lengths")
                  : std::vector<std::int64_t>(static_cast<std::size_t>(b.batch), b.seq_len);
  b.labels = ints_from(d, "labels");
  return b;
}

teo::Batch batch_from(const teo::ModelConfig& cfg, const py::dict& d) {
  if (cfg.encoder_decoder()) return seq2seq_batch_from(d);
  if (cfg.patches_input()) return patches_batch_from(cfg, d);
  if (d.contains("pixels")) {
    throw teo::ConfigError(
        "the batch has \"pixels\", but the config reads tokens (input \"patches\" reads images)");
  }
  teo::Batch b;
  const auto tokens =
      py::array::ensure(d.contains("tokens") ? py::object(d["tokens"]) : py::none());
  if (!tokens || tokens.ndim() != 2) {
    throw teo::ShapeError("batch[\"tokens\"] must be a (batch, seq_len) integer array");
  }
  b.batch = tokens.shape(0);
  b.seq_len = tokens.shape(1);
  b.tokens = ints_from(d, "tokens");
  b.lengths = ints_from(d, "lengths");
  if (cfg.decoder()) {
    // its targets are its next tokens: labels given to a decoder would be silently unused
    if (d.contains("labels")) {
      throw teo::ConfigError(
          "the batch has \"labels\", but a decoder reads none (position t's target is token t + "
          "1)");
    }
  } else {
    b.labels = ints_from(d, "labels");
  }
  if (cfg.embeddings.type_vocab_size) {
    b.token_types = ints_from(d, "token_types");
  } else if (d.contains("token_types")) {
    throw teo::ConfigError(
        "the batch has \"token_types\", but the config has no type_vocab_size: they would be "
        "silently unused");
  }
  return b;
}

template <class Real>
py::dict params_dict(const teo::Params<Real>& p) {
  py::dict out;
  p.visit([&](const std::string& name, const teo::Tensor<Real>& t) {
    py::array_t<Real> a(t.shape().dims());
    if (t.numel() > 0)
      std::memcpy(a.mutable_data(), t.data(), static_cast<std::size_t>(t.numel()) * sizeof(Real));
    out[name.c_str()] = std::move(a);
  });
  return out;
}

std::optional<teo::Precision> precision_of(const std::optional<std::string>& p) {
  if (!p) return std::nullopt;
  return teo::parse_precision(*p, "precision");
}

// teo.run's fp8 recipe: a JSON object of the fp8 keys an op spec takes (docs/fp8.md), read only
// under precision fp8; an unknown key, a bad value, or a recipe without fp8 is a ConfigError.
teo::Fp8Recipe fp8_recipe_of(const std::string& text, std::optional<teo::Precision> p) {
  if (p != teo::Precision::fp8) {
    throw teo::ConfigError("fp8 (the recipe) applies with precision=\"fp8\" only, got precision=" +
                           (p ? "\"" + std::string(teo::to_string(*p)) + "\"" : "None"));
  }
  const nlohmann::json j = nlohmann::json::parse(text);
  if (!j.is_object()) throw teo::ConfigError("fp8 must be a dict of fp8_* keys");
  const auto& keys = teo::golden::detail::fp8_keys();
  for (const auto& [k, v] : j.items()) {
    if (std::find(keys.begin(), keys.end(), k) == keys.end())
      throw teo::ConfigError("fp8: unknown key \"" + k + "\"" + teo::did_you_mean(k, keys));
  }
  teo::Fp8Recipe r;
  teo::golden::detail::read_fp8_keys(j, r, "fp8");
  teo::validate(r, "fp8");
  return r;
}

// ---- the exceptions -----------------------------------------------------------------------------

// Raises the Python class teo.<name> (defined in teo/__init__.py with its builtin base).
[[noreturn]] void raise_as(const char* name, const char* what) {
  const py::object cls = py::module_::import("teo").attr(name);
  PyErr_SetString(cls.ptr(), what);
  throw py::error_already_set();
}

}  // namespace

PYBIND11_MODULE(_teo, m) {
  m.doc() = "teo's compiled core; use the teo package";

  // pybind11 takes a translator as void (*)(std::exception_ptr): by value.
  py::register_exception_translator(
      [](std::exception_ptr p) {  // NOLINT(performance-unnecessary-value-param)
        try {
          if (p) std::rethrow_exception(p);
        } catch (const teo::ConfigError& e) {
          raise_as("ConfigError", e.what());
        } catch (const teo::ShapeError& e) {
          raise_as("ShapeError", e.what());
        } catch (const teo::InputError& e) {
          raise_as("InputError", e.what());
        } catch (const teo::FormatError& e) {
          raise_as("FormatError", e.what());
        } catch (const teo::FileError& e) {
          raise_as("FileError", e.what());
        } catch (const teo::RangeError& e) {
          raise_as("RangeError", e.what());
        } catch (const teo::IllConditioned& e) {
          raise_as("IllConditioned", e.what());
        } catch (const teo::Error& e) {
          raise_as("Error", e.what());
        }
      });

  py::class_<teo::ModelConfig>(m, "ModelConfig")
      .def(py::init(
               [](const py::kwargs& kw) { return teo::ModelConfig::from_json_text(to_text(kw)); }),
           "ModelConfig(**keys): unknown keys and bad values raise ConfigError naming the field")
      .def_static(
          "from_json",
          [](const py::object& obj) {
            const std::string text =
                py::isinstance<py::str>(obj) ? obj.cast<std::string>() : to_text(obj);
            return teo::ModelConfig::from_json_text(text);
          },
          "From a JSON string or a dict")
      .def("to_dict", [](const teo::ModelConfig& c) { return from_text(c.to_json().dump()); })
      .def("to_json", [](const teo::ModelConfig& c) { return c.to_json().dump(); })
      .def("__eq__", [](const teo::ModelConfig& a, const teo::ModelConfig& b) { return a == b; })
      .def("__repr__",
           [](const teo::ModelConfig& c) { return "teo.ModelConfig(" + c.to_json().dump() + ")"; })
      .def("__getattr__", [](const teo::ModelConfig& c, const std::string& key) -> py::object {
        json j = c.to_json();
        // the block variants' and the architecture's keys, which to_json writes only when set
        const json all = {{"architecture", teo::to_string(c.architecture)},
                          {"norm", teo::to_string(c.norms.norm)},
                          {"ffn", teo::to_string(c.ffn.kind)},
                          {"ffn_bias", c.ffn.ffn_bias},
                          {"attn_bias", c.attention.attn_bias},
                          {"attn_out_bias", c.attention.out_bias()},
                          {"head_bias", c.head.head_bias},
                          {"tie_embeddings", c.head.tie_embeddings}};
        for (const auto& [k, v] : all.items())
          if (!j.contains(k)) j[k] = v;
        if (!j.contains(key)) throw py::attribute_error("ModelConfig has no field " + key);
        return from_text(j.at(key).dump());
      });

  m.def(
      "init_params",
      [](const teo::ModelConfig& cfg, std::uint64_t seed, const std::string& dtype) -> py::dict {
        if (dtype == "float64") return params_dict(teo::Params<double>::init(cfg, seed));
        if (dtype == "float32") return params_dict(teo::Params<float>::init(cfg, seed));
        throw teo::ConfigError("dtype must be \"float32\" or \"float64\", got \"" + dtype + "\"");
      },
      py::arg("cfg"), py::arg("seed"), py::arg("dtype") = "float64");

  m.def(
      "random_batch",
      [](const teo::ModelConfig& cfg, teo::index_t batch, teo::index_t seq_len, std::uint64_t seed,
         const std::optional<std::vector<std::int64_t>>& lengths, teo::index_t tgt_len,
         const std::optional<std::vector<std::int64_t>>& tgt_lengths) {
        const std::vector<std::int64_t> none;
        if (cfg.encoder_decoder()) {
          teo::validate_batch_shape(cfg, {batch, seq_len, tgt_len}, sizeof(double));
          const teo::Batch b =
              teo::Batch::random_seq2seq(cfg, batch, seq_len, tgt_len, seed, lengths.value_or(none),
                                         tgt_lengths.value_or(none));
          py::dict out;
          const auto ints = [](const std::vector<std::int64_t>& v,
                               const std::vector<py::ssize_t>& shape) {
            py::array_t<std::int64_t> a(shape);
            if (!v.empty()) std::memcpy(a.mutable_data(), v.data(), v.size() * 8);
            return a;
          };
          out["src_tokens"] = ints(b.tokens, {b.batch, b.seq_len});
          out["src_lengths"] = ints(b.lengths, {b.batch});
          out["tgt_tokens"] = ints(b.tgt_tokens, {b.batch, b.tgt_len});
          out["tgt_lengths"] = ints(b.tgt_lengths, {b.batch});
          return out;
        }
        if (tgt_len != 0 || tgt_lengths) {
          throw teo::ConfigError(
              "tgt_len and tgt_lengths apply only to architecture \"encoder_decoder\"");
        }
        teo::validate_batch_shape(cfg, {batch, seq_len}, sizeof(double));
        const teo::Batch b = teo::Batch::random(cfg, batch, seq_len, seed, lengths.value_or(none));
        py::dict out;
        if (cfg.patches_input()) {
          py::array_t<double> pixels({b.batch, cfg.embeddings.channels, cfg.embeddings.image_size,
                                      cfg.embeddings.image_size});
          if (!b.pixels.empty())
            std::memcpy(pixels.mutable_data(), b.pixels.data(), b.pixels.size() * 8);
          out["pixels"] = pixels;
        } else {
          py::array_t<std::int64_t> tokens({b.batch, b.seq_len});
          if (!b.tokens.empty())
            std::memcpy(tokens.mutable_data(), b.tokens.data(), b.tokens.size() * 8);
          out["tokens"] = tokens;
        }
        out["lengths"] =
            py::array_t<std::int64_t>(static_cast<py::ssize_t>(b.lengths.size()), b.lengths.data());
        if (!cfg.decoder()) {
          out["labels"] =
              py::array_t<std::int64_t>(static_cast<py::ssize_t>(b.labels.size()), b.labels.data());
        }
        if (cfg.embeddings.type_vocab_size) {
          py::array_t<std::int64_t> types({b.batch, b.seq_len});
          if (!b.token_types.empty())
            std::memcpy(types.mutable_data(), b.token_types.data(), b.token_types.size() * 8);
          out["token_types"] = types;
        }
        return out;
      },
      py::arg("cfg"), py::arg("batch"), py::arg("seq_len"), py::arg("seed"),
      py::arg("lengths") = py::none(), py::arg("tgt_len") = 0, py::arg("tgt_lengths") = py::none());

  m.def(
      "run",
      [](const teo::ModelConfig& cfg, const py::dict& params, const py::dict& batch, bool train,
         std::uint64_t dropout_seed, const std::optional<std::string>& precision, bool backward,
         const std::optional<std::string>& backend, std::optional<int> threads,
         const std::string& dtype, const std::optional<py::dict>& masks,
         const std::optional<std::string>& fp8, const std::optional<py::dict>& routing) {
        const teo::Batch b = batch_from(cfg, batch);
        // router replay: layer index -> the experts of each (position, slot), B*S*k of them
        std::map<teo::index_t, std::vector<std::int32_t>> given;
        if (routing) {
          for (const auto& [k, v] : *routing) {
            const auto arr =
                py::array_t<std::int32_t, py::array::c_style | py::array::forcecast>::ensure(v);
            if (!arr)
              throw teo::ConfigError("routing must map layer indices to arrays of expert ids");
            given[k.cast<teo::index_t>()] =
                std::vector<std::int32_t>(arr.data(), arr.data() + arr.size());
          }
        }
        std::map<std::string, std::vector<std::uint8_t>> replay;
        if (masks) {
          for (const auto& [k, v] : *masks) {
            const auto arr =
                py::array_t<std::uint8_t, py::array::c_style | py::array::forcecast>::ensure(v);
            const std::string site = py::str(k).cast<std::string>();
            if (!arr) throw teo::ConfigError("mask " + site + " must be an array of 0 and 1");
            replay[site] = std::vector<std::uint8_t>(arr.data(), arr.data() + arr.size());
          }
        }
        const std::optional<teo::Precision> emulated = precision_of(precision);
        const teo::golden::RunOptions opts{
            train,
            dropout_seed,
            emulated,
            backward,
            masks ? &replay : nullptr,
            fp8 ? std::optional(fp8_recipe_of(*fp8, emulated)) : std::nullopt,
            routing ? &given : nullptr};
        const auto run_in = [&](auto real) {
          const auto p = params_from<decltype(real)>(cfg, params);
          return wire_of(
              compute([&] { return teo::golden::run_tensors(p, b, opts); }, backend, threads));
        };
        if (dtype == "float64") return run_in(double{});
        if (dtype == "float32") return run_in(float{});
        throw teo::ConfigError("params must be float32 or float64 arrays");
      },
      py::arg("cfg"), py::arg("params"), py::arg("batch"), py::arg("train"),
      py::arg("dropout_seed"), py::arg("precision"), py::arg("backward"), py::arg("backend"),
      py::arg("threads"), py::arg("dtype"), py::arg("masks"), py::arg("fp8"), py::arg("routing"));

  m.def(
      "generate",
      [](const teo::ModelConfig& cfg, const py::dict& params, const py::dict& prompt,
         teo::index_t steps, std::int64_t start_token, const std::optional<py::object>& feed,
         const std::optional<std::string>& backend, std::optional<int> threads,
         const std::string& dtype) {
        const teo::Batch b = batch_from(cfg, prompt);
        // feed: (steps, B) integers, the tokens to feed instead of the greedy ones
        std::vector<std::vector<std::int64_t>> fed;
        if (feed) {
          const auto arr = py::array::ensure(*feed);
          if (!arr || arr.ndim() != 2 || arr.dtype().kind() != 'i') {
            throw teo::ConfigError("feed must be a (steps, batch) integer array");
          }
          const auto c =
              py::array_t<std::int64_t, py::array::c_style | py::array::forcecast>::ensure(arr);
          for (py::ssize_t t = 0; t < c.shape(0); ++t)
            fed.emplace_back(c.data(t, 0), c.data(t, 0) + c.shape(1));
        }
        const auto gen_in = [&](auto real) {
          using Real = decltype(real);
          const auto p = params_from<Real>(cfg, params);
          const auto g = compute(
              [&] {
                return teo::generate(
                    p, b,
                    {.steps = steps, .start_token = start_token, .feed = feed ? &fed : nullptr});
              },
              backend, threads);
          const auto T = static_cast<py::ssize_t>(g.tokens.size());
          const auto B = static_cast<py::ssize_t>(b.batch), V = cfg.embeddings.vocab_size;
          py::array_t<std::int64_t> tokens({T, B});
          py::array_t<Real> logits({T, B, static_cast<py::ssize_t>(V)});
          for (py::ssize_t t = 0; t < T; ++t) {
            const auto& tok = g.tokens[static_cast<std::size_t>(t)];
            if (B > 0) {
              std::memcpy(tokens.mutable_data(t), tok.data(), tok.size() * sizeof(std::int64_t));
              std::memcpy(logits.mutable_data(t), g.logits[static_cast<std::size_t>(t)].data(),
                          static_cast<std::size_t>(B * V) * sizeof(Real));
            }
          }
          py::dict out;
          out["tokens"] = tokens;
          out["logits"] = logits;
          return out;
        };
        if (dtype == "float64") return gen_in(double{});
        if (dtype == "float32") return gen_in(float{});
        throw teo::ConfigError("params must be float32 or float64 arrays");
      },
      py::arg("cfg"), py::arg("params"), py::arg("prompt"), py::arg("steps"),
      py::arg("start_token"), py::arg("feed"), py::arg("backend"), py::arg("threads"),
      py::arg("dtype"));

  m.def(
      "run_op",
      [](const std::string& op, const py::dict& spec, const std::vector<Wire>& inputs,
         const std::optional<std::string>& precision, const std::optional<std::string>& backend,
         std::optional<int> threads) {
        const auto c = teo::golden::OpCase::from_json(json::parse(to_text(spec)), op);
        auto f = file_of(
            {{"format", teo::golden::kOpFormat}, {"op", c.op}, {"spec", c.spec.dump()}}, inputs);
        const auto r = compute([&] { return teo::golden::run_op(f, precision_of(precision)); },
                               backend, threads);
        py::dict out;
        for (const auto& t : teo::golden::op_contract(c)) {
          const auto& v = r.at(t.name);
          if (t.integer) {  // the experts chosen: exact integers
            py::array_t<std::int32_t> ids(t.shape);
            for (std::size_t i = 0; i < v.size(); ++i)
              ids.mutable_data()[i] = static_cast<std::int32_t>(v[i]);
            out[t.name.c_str()] = std::move(ids);
            continue;
          }
          py::array_t<double> a(t.shape);
          if (!v.empty()) std::memcpy(a.mutable_data(), v.data(), v.size() * sizeof(double));
          out[t.name.c_str()] = std::move(a);
        }
        return out;
      },
      py::arg("op"), py::arg("spec"), py::arg("inputs"), py::arg("precision"), py::arg("backend"),
      py::arg("threads"));

  m.def("op_spec", [](const std::string& op, const py::dict& spec) {
    return from_text(teo::golden::OpCase::from_json(json::parse(to_text(spec)), op).spec.dump());
  });
  m.def("op_contract", [](const std::string& op, const py::dict& spec) {
    const auto c = teo::golden::OpCase::from_json(json::parse(to_text(spec)), op);
    std::vector<std::tuple<std::string, std::vector<std::int64_t>, bool>> out;
    // the third: whether the output takes no upstream gradient (optional, a router's choice)
    for (const auto& t : teo::golden::op_contract(c))
      out.emplace_back(t.name, t.shape, t.optional || !t.upstream);
    return out;
  });
  m.def(
      "make_op",
      [](const std::string& op, const py::dict& spec, const std::optional<std::string>& backend,
         std::optional<int> threads) {
        const auto c = teo::golden::OpCase::from_json(json::parse(to_text(spec)), op);
        const auto f = compute([&] { return teo::golden::make_op(c); }, backend, threads);
        return std::make_pair(f.metadata, wire_of(f));
      },
      py::arg("op"), py::arg("spec"), py::arg("backend") = py::none(),
      py::arg("threads") = py::none());
  // The keys an op's spec takes, from the registry: op, dtype, seed and precision, the op's config
  // keys and lengths, and every key its samples' normalised specs spell out. An unknown op is a
  // ConfigError listing the ops.
  m.def("op_keys", [](const std::string& op) { return teo::golden::op_spec_keys(op); });

  m.def(
      "read",
      [](const std::string& path, bool validate) {
        const auto f = teo::safetensors::read(path);
        // A golden or op case is checked against its contract before anything reads it.
        if (const auto* fmt = f.meta("format");
            validate && fmt && (*fmt == teo::golden::kFormat || *fmt == teo::golden::kOpFormat))
          teo::golden::validate(f);
        return std::make_pair(f.metadata, wire_of(f));
      },
      py::arg("path"), py::arg("validate") = true);
  m.def(
      "write",
      [](const std::string& path, const std::vector<std::pair<std::string, std::string>>& metadata,
         const std::vector<Wire>& tensors, bool force) {
        const std::string bytes = teo::safetensors::serialize(file_of(metadata, tensors));
        py::gil_scoped_release release;
        teo::write_file_atomic(path, bytes, force);
      },
      py::arg("path"), py::arg("metadata"), py::arg("tensors"), py::arg("force"));

  m.def("check", [](const std::vector<std::pair<std::string, std::string>>& gmeta,
                    const std::vector<Wire>& gtensors, const std::vector<Wire>& ctensors,
                    const std::string& name, const std::string& golden_path,
                    const std::string& candidate_path, const std::optional<std::string>& precision,
                    const std::string& only, bool require_all, bool allow_extra,
                    bool hide_unchecked, const py::dict& tolerances) {
    teo::golden::CheckOptions o;
    o.precision = precision_of(precision);
    o.allow_extra = allow_extra;
    if (only == "forward")
      o.only = teo::golden::Only::forward;
    else if (only == "backward")
      o.only = teo::golden::Only::backward;
    else if (only != "all")
      throw teo::ConfigError("only must be \"forward\" or \"backward\", got \"" + only + "\"");
    for (const auto& [k, v] : tolerances) {
      const std::string key = py::str(k).cast<std::string>();
      const double x = v.cast<double>();
      if (!(x >= 0)) throw teo::ConfigError(key + " must be a number >= 0");
      if (key == "rtol")
        o.rtol = x;
      else if (key == "atol")
        o.atol = x;
      else if (key == "k")
        o.k = x;
      else if (key == "floor_eps")
        o.floor_eps = x;
      else if (key == "budget_k")
        o.budget_k = x;
      else if (key == "budget_floor")
        o.budget_floor = x;
      else if (key == "fp8_recipe_k")
        o.fp8_recipe_k = x;
      else
        throw teo::ConfigError("unknown check option \"" + key + "\"");
    }
    const auto g = file_of(gmeta, gtensors);
    const auto c = file_of({}, ctensors);
    auto rep = compute([&] { return teo::golden::check(g, c, o); });
    rep.name = name;
    rep.golden_path = golden_path;
    rep.candidate_path = candidate_path;
    std::ostringstream text;
    teo::golden::print_text({rep}, text, {.hide_unchecked = hide_unchecked});
    const auto v = teo::golden::verdict({rep}, require_all);
    return std::make_tuple(text.str(), teo::golden::json_report({rep}), v.exit_code, v.reason);
  });

  m.attr("__version__") = TEO_VERSION;
  m.attr("kFormat") = teo::golden::kFormat;
  m.attr("kOpFormat") = teo::golden::kOpFormat;
}
