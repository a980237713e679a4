#include "teo/suggest.hpp"

#include <algorithm>
#include <cstddef>

namespace teo {

std::size_t edit_distance(std::string_view a, std::string_view b) {
  // Three rows of the dynamic programme: i - 2, i - 1 and i.
  std::vector<std::size_t> before(b.size() + 1), prev(b.size() + 1), cur(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t cost = a[i - 1] == b[j - 1] ? 0 : 1;
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + cost});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1])
        cur[j] = std::min(cur[j], before[j - 2] + 1);
    }
    std::swap(before, prev);
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

namespace {

std::vector<std::string_view> words_of(std::string_view s) {
  std::vector<std::string_view> out;
  std::size_t start = 0;
  for (std::size_t i = 0; i <= s.size(); ++i) {
    if (i == s.size() || s[i] == '_' || s[i] == '-' || s[i] == '.') {
      if (i > start) out.push_back(s.substr(start, i - start));
      start = i + 1;
    }
  }
  return out;
}

// Whether a and b are the same words, each of a a prefix of a distinct word of b or the reverse,
// in any order.
bool same_words(std::string_view a, std::string_view b) {
  const auto wa = words_of(a), wb = words_of(b);
  if (wa.size() != wb.size() || wa.size() < 2) return false;
  std::vector<bool> used(wb.size(), false);
  for (const auto x : wa) {
    bool found = false;
    for (std::size_t j = 0; j < wb.size() && !found; ++j) {
      if (used[j]) continue;
      const auto y = wb[j];
      if (x.substr(0, y.size()) == y || y.substr(0, x.size()) == x) found = used[j] = true;
    }
    if (!found) return false;
  }
  return true;
}

// The part of a name a typo is measured against: without leading dashes (a flag) and without a
// ".safetensors" extension (a file).
std::string_view stem(std::string_view s) {
  while (!s.empty() && s.front() == '-') s.remove_prefix(1);
  constexpr std::string_view ext = ".safetensors";
  if (s.size() > ext.size() && s.substr(s.size() - ext.size()) == ext) s.remove_suffix(ext.size());
  return s;
}

}  // namespace

std::string closest_match(std::string_view word, const std::vector<std::string>& candidates) {
  // At most one edit in three of the word's stem, and fewer edits than the shorter stem has
  // characters ("-v" is not a typo of "-h", nor "p" of "op").
  const std::size_t limit = std::max<std::size_t>(1, stem(word).size() / 3);
  const std::string* best = nullptr;
  std::size_t best_d = limit + 1;
  for (const auto& c : candidates) {
    if (c == word) continue;
    const std::size_t d = edit_distance(word, c);
    if (d < best_d && d < std::min(stem(word).size(), stem(c).size())) {
      best_d = d;
      best = &c;
    }
  }
  if (best) return *best;
  for (const auto& c : candidates)
    if (c != word && same_words(word, c)) return c;
  return "";
}

std::string did_you_mean(std::string_view word, const std::vector<std::string>& candidates) {
  const std::string m = closest_match(word, candidates);
  return m.empty() ? "" : "; did you mean \"" + m + "\"?";
}

}  // namespace teo
