// Training, as a library: data (teo/train/data.hpp), settings (options.hpp), optimisation
// (optim.hpp), checkpoints (checkpoint.hpp), the Trainer (trainer.hpp), what a run records
// (log.hpp) and the demo's whole run (session.hpp). docs/training.md specifies every step.
#pragma once

#include "teo/train/checkpoint.hpp"
#include "teo/train/data.hpp"
#include "teo/train/log.hpp"
#include "teo/train/optim.hpp"
#include "teo/train/options.hpp"
#include "teo/train/session.hpp"
#include "teo/train/trainer.hpp"
