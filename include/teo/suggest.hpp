// Suggestions for a misspelled name: a flag, a command, a config or spec key, an op, a tensor.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace teo {

// The number of single-character insertions, deletions, substitutions and transpositions of
// adjacent characters that turn a into b (the optimal string alignment distance).
std::size_t edit_distance(std::string_view a, std::string_view b);

// The candidate `word` most likely misspells, or "" when none is close: the nearest by
// edit_distance within max(1, |stem| / 3) and below both stems' lengths (the stem: without
// leading dashes and a ".safetensors" extension), else one made of the same words in another
// order or abbreviated ("head_dim" for "d_head": words split at '_', '-' and '.', each a prefix of
// one of the other's). Ties go to the earlier candidate; `word` itself is never suggested.
std::string closest_match(std::string_view word, const std::vector<std::string>& candidates);

// "; did you mean \"X\"?" with X = closest_match(word, candidates), or "" when there is none.
std::string did_you_mean(std::string_view word, const std::vector<std::string>& candidates);

}  // namespace teo
