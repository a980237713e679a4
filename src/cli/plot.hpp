// curves.png: loss and accuracy against the step, drawn by gnuplot from metrics.csv.
#pragma once

#include <string>

namespace teo::cli {

// Returns false when gnuplot is missing or fails; never leaves a partial png behind.
bool plot_curves(const std::string& csv, const std::string& png);

}  // namespace teo::cli
