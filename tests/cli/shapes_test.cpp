// `teo shapes` end to end: the real binary, its output and its exit codes.
#include <array>
#include <cstdio>
#include <fstream>
#include <string>

#include <gtest/gtest.h>

#include "cli/run_cli.hpp"

namespace {

using teo::test::CliResult;
using teo::test::run_cli;

TEST(ShapesCli, PrintsEveryStageForwardAndBackward) {
  const CliResult r = run_cli("shapes");
  ASSERT_EQ(r.code, 0) << r.out;
  for (const char* line : {"input.tokens", "act.embedding", "act.layers.1.scores",
                           "act.layers.1.ffn_hidden", "act.pooled", "act.logits", "act.loss",
                           "grad.act.input", "grad.layers.0.attn.q.weight", "grad.head.bias"})
    EXPECT_NE(r.out.find(line), std::string::npos) << line;
  EXPECT_NE(r.out.find("[B, H, S, S]    [2, 2, 8, 8]"), std::string::npos);
  // forward comes before backward, and the backward walks from the loss to the input
  EXPECT_LT(r.out.find("act.loss"), r.out.find("grad.act.loss"));
  EXPECT_LT(r.out.find("grad.act.logits"), r.out.find("grad.act.input"));
}

TEST(ShapesCli, ReadsAConfigFile) {
  const std::string path = ::testing::TempDir() + "teo_shapes_cfg.json";
  std::ofstream(path)
      << R"({"d_model": 6, "num_heads": 3, "d_ff": 5, "num_layers": 1, "norm_first": true})";
  const CliResult r = run_cli("shapes --config " + path + " --batch 3 --seq-len 4 --dtype float32");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("act.final_norm"), std::string::npos);
  EXPECT_NE(r.out.find("[B, H, S, Dh]   [3, 3, 4, 2]"), std::string::npos) << r.out;
}

// The contract's shapes for grouped-query attention with RoPE and sinks: q_rot has H heads, k and
// its rotation Hkv, the sinks one logit per head.
TEST(ShapesCli, PrintsTheContractsShapesForGqaRopeAndSinks) {
  const std::string path = ::testing::TempDir() + "teo_shapes_gqa.json";
  std::ofstream(path) << R"({"d_model": 24, "num_heads": 6, "num_kv_heads": 2, "num_layers": 1,
                            "positional": "rope", "attn_sinks": true, "dropout": 0.1})";
  const CliResult r = run_cli("shapes --config " + path + " --batch 2 --seq-len 5");
  ASSERT_EQ(r.code, 0) << r.out;
  for (const char* line : {"act.layers.0.q_rot                [B, H, S, Dh]   [2, 6, 5, 4]\n",
                           "act.layers.0.k                    [B, Hkv, S, Dh] [2, 2, 5, 4]\n",
                           "act.layers.0.k_rot                [B, Hkv, S, Dh] [2, 2, 5, 4]\n",
                           "grad.act.layers.0.v               [B, Hkv, S, Dv] [2, 2, 5, 4]\n",
                           "grad.layers.0.attn.sinks          [H]             [6]\n",
                           "grad.layers.0.attn.k.weight       [Hkv*Dh, D]     [8, 24]\n",
                           "dropout.layers.0.attn             [B, H, S, S]    [2, 6, 5, 5]\n"})
    EXPECT_NE(r.out.find(line), std::string::npos) << line << r.out;
}

// A mixture of experts (semantics 19.4): the dense first layer's FFN, the MoE layer's router and
// grouped rows (every position routed: B S k rows), the shared experts and the loss term; the
// selection bias has no gradient.
TEST(ShapesCli, PrintsTheMixtureOfExpertsTensors) {
  const std::string path = ::testing::TempDir() + "teo_shapes_moe.json";
  std::ofstream(path) << R"({"architecture": "decoder", "ffn": "moe", "num_layers": 2,
      "num_experts": 4, "num_experts_per_tok": 2, "moe_d_ff": 6, "shared_d_ff": 8,
      "first_dense_layers": 1, "selection_bias": true, "router_aux_loss_coef": 0.01})";
  const CliResult r = run_cli("shapes --config " + path + " --batch 2 --seq-len 3");
  ASSERT_EQ(r.code, 0) << r.out;
  for (const char* line :
       {"E=4 k=2 Fe=6 Fs=8", "act.layers.0.ffn_hidden           [B, S, F]       [2, 3, 32]\n",
        "act.layers.1.moe.logits           [B, S, E]       [2, 3, 4]\n",
        "act.layers.1.moe.expert_hidden    [B*S*k, Fe]     [12, 6]\n",
        "act.layers.1.moe.shared_out       [B, S, D]       [2, 3, 16]\n",
        "act.moe_aux_loss                  []              []\n",
        "grad.layers.1.moe.experts.w_down  [E, D, Fe]      [4, 16, 6]\n"})
    EXPECT_NE(r.out.find(line), std::string::npos) << line << r.out;
  for (const char* absent : {"moe.gate.e_score_correction_bias", "moe.shared_gate", "layers.0.moe"})
    EXPECT_EQ(r.out.find(absent), std::string::npos) << absent;
}

// --steps: a decoder's generation tensors, their shapes from the contract and the run; an encoder,
// or steps past max_len, is a named error.
TEST(ShapesCli, PrintsTheGenerationStepsOfADecoder) {
  const std::string path = ::testing::TempDir() + "teo_shapes_decoder.json";
  std::ofstream(path) << R"({"architecture": "decoder", "vocab_size": 11, "max_len": 9,
                            "positional": "rope", "num_layers": 1})";
  CliResult r = run_cli("shapes --config " + path + " --batch 3 --seq-len 5 --steps 4");
  ASSERT_EQ(r.code, 0) << r.out;
  for (const char* line :
       {"generation (4 steps)\n", "input.generate.tokens             [T, B]          [4, 3]\n",
        "act.generate.0.logits             [B, Vt]         [3, 11]\n",
        "act.generate.3.logits             [B, Vt]         [3, 11]\n"})
    EXPECT_NE(r.out.find(line), std::string::npos) << line << r.out;
  EXPECT_EQ(r.out.find("act.generate.4."), std::string::npos) << r.out;
  r = run_cli("shapes --config " + path + " --seq-len 5 --steps 5");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("--steps 5 after a prompt of 5 tokens runs past max_len 9"),
            std::string::npos)
      << r.out;
  EXPECT_EQ(r.out.find("forward"), std::string::npos) << "nothing printed before the error";
  r = run_cli("shapes --steps 2");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("--steps needs a decoder"), std::string::npos) << r.out;
}

// An encoder_decoder: the decoder's tensors over the target length, cross-attention over the
// source's; --tgt-len belongs to it alone.
TEST(ShapesCli, PrintsAnEncoderDecodersDecoderTensors) {
  const std::string path = ::testing::TempDir() + "teo_shapes_seq2seq.json";
  std::ofstream(path) << R"({"architecture": "encoder_decoder", "vocab_size": 11, "max_len": 9,
                            "num_layers": 1, "decoder_vocab_size": 13})";
  CliResult r = run_cli("shapes --config " + path + " --batch 2 --seq-len 5 --tgt-len 7");
  ASSERT_EQ(r.code, 0) << r.out;
  for (const char* line : {"input.tgt_tokens                  [B, St]         [2, 7]\n",
                           "act.decoder.layers.0.cross_attn.scores [B, H, St, S]   [2, 2, 7, 5]\n",
                           "act.lm_logits                     [B, St, Vt]     [2, 7, 13]\n",
                           "grad.decoder.embedding.weight     [Vt, D]         [13, 16]\n"})
    EXPECT_NE(r.out.find(line), std::string::npos) << line << r.out;
  r = run_cli("shapes --tgt-len 4");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("--tgt-len applies only"), std::string::npos) << r.out;
}

TEST(ShapesCli, DefaultSequenceLengthFitsASmallMaxLen) {
  const std::string path = ::testing::TempDir() + "teo_shapes_short.json";
  std::ofstream(path) << R"({"max_len": 3})";
  const CliResult r = run_cli("shapes --config " + path);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("[S, D]          [3, 16]"), std::string::npos) << r.out;
}

TEST(ShapesCli, HugeConfigFailsCleanlyNotWithACrash) {
  const std::string path = ::testing::TempDir() + "teo_shapes_huge.json";
  std::ofstream(path) << R"({"vocab_size": 1000000000000000, "d_model": 16})";
  const CliResult r = run_cli("shapes --config " + path);
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("teo: error:"), std::string::npos) << r.out;
}

TEST(ShapesCli, BadInputExitsTwoWithTheFieldNamed) {
  const std::string path = ::testing::TempDir() + "teo_shapes_bad.json";
  std::ofstream(path) << R"({"d_model": 10, "num_heads": 4})";
  CliResult r = run_cli("shapes --config " + path);
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.out.find("d_model must be divisible by num_heads"), std::string::npos) << r.out;
  std::ofstream(path) << R"({"d_model": 8, "dropuot": 0.1})";
  r = run_cli("shapes --config " + path);
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.out.find("dropuot"), std::string::npos) << r.out;
  r = run_cli("shapes --seq-len 33");  // default max_len is 32
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.out.find("max_len"), std::string::npos) << r.out;
  r = run_cli("shapes --dtype float16");
  EXPECT_EQ(r.code, 2);
  r = run_cli("frobnicate");
  EXPECT_EQ(r.code, 2);
}

}  // namespace
