// Training, as a library: data (teo/train/data.hpp), settings (options.hpp), optimisation
// (optim.hpp), checkpoints (checkpoint.hpp) and the Trainer (trainer.hpp). docs/training.md
// specifies every step.
#pragma once

#include "teo/train/checkpoint.hpp"
#include "teo/train/data.hpp"
#include "teo/train/optim.hpp"
#include "teo/train/options.hpp"
#include "teo/train/trainer.hpp"
