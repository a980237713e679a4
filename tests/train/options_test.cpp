// teo/train/options.hpp: every setting is named when it is bad, and flags parse by type.
#include <filesystem>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "teo/train/options.hpp"

namespace {

namespace fs = std::filesystem;
namespace tr = teo::train;
using teo::train::TrainOptions;

TEST(TrainOptions, BadSettingsAreNamed) {
  TrainOptions o;
  EXPECT_THROW(o.apply_json({{"vocab_size", 10}}), teo::ConfigError);
  EXPECT_THROW(o.apply_json({{"no_such_key", 1}}), teo::ConfigError);
  EXPECT_THROW(o.apply_json({{"lr", "fast"}}), teo::ConfigError);
  o.apply_json({{"batch_size", 0}});
  EXPECT_THROW(o.validate(), teo::ConfigError);
  o = TrainOptions{};
  o.apply_json({{"shards", 0}});
  EXPECT_THROW(o.validate(), teo::ConfigError);
  o = TrainOptions{};
  o.apply_json({{"ema", 1.0}});
  EXPECT_THROW(o.validate(), teo::ConfigError);
  EXPECT_THROW(tr::parse_flag_value({"epochs", "int", ""}, "3x"), teo::ConfigError);
  EXPECT_EQ(tr::parse_flag_value({"lr", "real", ""}, "0.5"), 0.5);
  // --seed arrives as a signed integer from the command line and unsigned from a JSON file.
  o = TrainOptions{};
  o.apply_json({{"seed", tr::parse_flag_value({"seed", "int", ""}, "5")}});
  EXPECT_EQ(o.seed, 5u);
  o.apply_json(nlohmann::json::parse(R"({"seed": 18446744073709551615})"));
  EXPECT_EQ(o.seed, 18446744073709551615u);
  EXPECT_THROW(o.apply_json({{"seed", -1}}), teo::ConfigError);
  EXPECT_THROW(o.apply_json({{"seed", 1.5}}), teo::ConfigError);
  EXPECT_EQ(tr::parse_flag_value({"norm_first", "bool", ""}, "false"), false);
  // an encoder_decoder is refused by the options a Trainer validates, not only by apply_json
  o = TrainOptions{};
  o.model.architecture = teo::Architecture::encoder_decoder;
  EXPECT_THROW(o.validate(), teo::ConfigError);
  EXPECT_THROW(o.apply_json({{"architecture", "encoder_decoder"}}), teo::ConfigError);
  // token types have no data in the demo; the embedding norm and the pooler train
  o = TrainOptions{};
  o.model.embeddings.type_vocab_size = 2;
  EXPECT_THROW(o.validate(), teo::ConfigError);
  o.model.embeddings.type_vocab_size.reset();
  o.model.embeddings.embedding_norm = true;
  o.model.head.pooler = teo::Pooler::dense_tanh;
  EXPECT_NO_THROW(o.validate());
  // an architecture that is not a string is a ConfigError naming the key, not a JSON type error
  o = TrainOptions{};
  try {
    o.apply_json({{"architecture", 20500001}});
    ADD_FAILURE() << "a numeric architecture was accepted";
  } catch (const teo::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("architecture"), std::string::npos) << e.what();
  }
}

}  // namespace
