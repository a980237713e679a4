// The names of the config's enumerations, as the config's JSON spells them.
#include "teo/config.hpp"

namespace teo {

const char* to_string(Activation a) {
  switch (a) {
    case Activation::relu:
      return "relu";
    case Activation::gelu:
      return "gelu";
    case Activation::gelu_tanh:
      return "gelu_tanh";
    case Activation::silu:
      return "silu";
  }
  return "?";
}
const char* to_string(Positional p) {
  switch (p) {
    case Positional::sinusoidal:
      return "sinusoidal";
    case Positional::learned:
      return "learned";
    case Positional::none:
      return "none";
    case Positional::rope:
      return "rope";
    case Positional::alibi:
      return "alibi";
  }
  return "?";
}
const char* to_string(RopeStyle s) {
  return s == RopeStyle::neox ? "neox" : "interleaved";
}
const char* to_string(RopeScalingType t) {
  switch (t) {
    case RopeScalingType::none:
      return "none";
    case RopeScalingType::linear:
      return "linear";
    case RopeScalingType::ntk:
      return "ntk";
    case RopeScalingType::yarn:
      return "yarn";
  }
  return "?";
}
const char* to_string(Architecture a) {
  return a == Architecture::encoder   ? "encoder"
         : a == Architecture::decoder ? "decoder"
                                      : "encoder_decoder";
}
const char* to_string(Norm n) {
  return n == Norm::layernorm ? "layernorm" : "rmsnorm";
}
const char* to_string(Pooler p) {
  return p == Pooler::none ? "none" : "dense_tanh";
}
const char* to_string(LayerAttention a) {
  return a == LayerAttention::sliding ? "sliding_attention" : "full_attention";
}
const char* to_string(InputKind k) {
  return k == InputKind::tokens ? "tokens" : "patches";
}
const char* to_string(FfnKind f) {
  switch (f) {
    case FfnKind::mlp:
      return "mlp";
    case FfnKind::swiglu:
      return "swiglu";
    case FfnKind::geglu:
      return "geglu";
    case FfnKind::moe:
      return "moe";
  }
  return "?";
}
const char* to_string(Pooling p) {
  switch (p) {
    case Pooling::mean:
      return "mean";
    case Pooling::cls:
      return "cls";
    case Pooling::max:
      return "max";
  }
  return "?";
}

}  // namespace teo
