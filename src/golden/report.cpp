#include "teo/golden.hpp"

#include <iomanip>
#include <sstream>

#include <nlohmann/json.hpp>

namespace teo::golden {

using nlohmann::json;
using safetensors::DType;
using safetensors::File;

namespace {

const char* status_str(Status s) {
  switch (s) {
    case Status::pass:
      return "pass";
    case Status::fail:
      return "FAIL";
    case Status::not_checked:
      return "not checked";
    case Status::vacuous:
      return "VACUOUS (not judged)";
    case Status::ambiguous:
      return "AMBIGUOUS (not judged)";
  }
  return "?";
}

std::string sci(double v) {
  std::ostringstream os;
  os << std::scientific << std::setprecision(2) << v;
  return os.str();
}

std::string xml_escape(const std::string& s) {
  std::string o;
  for (char ch : s) {
    switch (ch) {
      case '&':
        o += "&amp;";
        break;
      case '<':
        o += "&lt;";
        break;
      case '>':
        o += "&gt;";
        break;
      case '"':
        o += "&quot;";
        break;
      case '\'':
        o += "&apos;";
        break;
      default:
        o += ch;
    }
  }
  return o;
}

}  // namespace

void print_text(const std::vector<CaseReport>& reports, std::ostream& out,
                const TextOptions& text) {
  int passed = 0, failed = 0, not_checked = 0, cases_failed = 0;
  std::vector<std::string> no_candidate, no_golden;
  for (const auto& rep : reports) {
    if (rep.no_golden) {
      out << "case " << rep.name << "  (candidate " << rep.candidate_path
          << "): no golden of this name";
      if (!rep.suggestion.empty()) out << "; did you mean " << rep.suggestion << "?";
      out << (rep.accepted ? "  (accepted by --allow-extra)" : "  FAIL") << "\n\n";
      no_golden.push_back(rep.candidate_path);
      continue;
    }
    out << "case " << rep.name << "  (golden " << rep.golden_path << ", candidate "
        << rep.candidate_path << ")\n";
    for (const auto& n : rep.notes) out << "  note: " << n << "\n";
    if (rep.budget) {
      out << "  judged as " << rep.precision << ": err/bound = max|candidate - truth| / (k * "
          << "max|emulated - truth| + floor * u * scale); emulated = the emulated run's error / "
          << "scale\n";
      if (rep.precision == "fp8") {
        out << (rep.recipe_rule
                    ? "  fp8 recipe rule: |candidate - emulated| beyond one bf16 step <= "
                      "fp8_recipe_k * max|emulated - truth| (docs/fp8.md)\n"
                    : "  fp8 recipe rule: reported, not judged (some fp8 operand is computed, not "
                      "a "
                      "golden input: docs/fp8.md)\n");
      }
      out << "  emulated reference: " << std::fixed << std::setprecision(1)
          << static_cast<double>(rep.emulated_bytes) / 1e6 << " MB, computed once for this case\n";
      out.unsetf(std::ios::floatfield);
    }
    const bool no_file = !rep.tensors.empty() &&
                         rep.not_checked == static_cast<int>(rep.tensors.size()) &&
                         rep.tensors.front().message == "no candidate file";
    if (no_file) {
      out << "  no candidate file: " << rep.not_checked << " tensors not checked\n\n";
      not_checked += rep.not_checked;
      no_candidate.push_back(rep.golden_path);
      continue;
    }
    out << "  " << std::left << std::setw(44) << "tensor" << std::right << std::setw(11)
        << "max_abs" << std::setw(11) << "max_rel" << std::setw(11) << "err/bound";
    // fp8: each tensor's distance from the emulated run in its errors (the recipe rule's)
    const bool fp8 = rep.budget && rep.precision == "fp8";
    if (rep.budget) out << std::setw(11) << "emulated";
    if (fp8) out << std::setw(11) << "recipe";
    out << "  result\n";
    for (const auto& t : rep.tensors) {
      if (text.hide_unchecked && t.status == Status::not_checked) continue;
      out << "  " << std::left << std::setw(44) << t.name << std::right;
      const int columns = fp8 ? 55 : rep.budget ? 44 : 33;
      if (t.status == Status::not_checked) {
        out << std::setw(11) << "-" << std::setw(11) << "-" << std::setw(11) << "-";
        if (rep.budget) out << std::setw(11) << "-";
        if (fp8) out << std::setw(11) << "-";
      } else if (!t.compared) {
        // what differs, in the numbers' place: there are no numbers to compare
        out << std::setw(columns) << t.mismatch;
      } else {
        out << std::setw(11) << sci(t.max_abs) << std::setw(11) << sci(t.max_rel) << std::setw(11)
            << sci(t.ratio);
        if (rep.budget) out << std::setw(11) << sci(t.emulated_err);
        if (fp8) out << std::setw(11) << sci(t.recipe_distance);
      }
      out << "  " << status_str(t.status);
      if (!t.message.empty() && t.status != Status::pass && t.message != t.mismatch)
        out << "  (" << t.message << ")";
      if (!t.excluded.empty()) out << "  (" << t.excluded << ")";
      out << "\n";
    }
    if (text.hide_unchecked && rep.not_checked > 0)
      out << "  (" << rep.not_checked << " rows of tensors not checked hidden)\n";
    if (!rep.first_divergence.empty())
      out << "  first divergence: " << rep.first_divergence << "\n";
    // Not checked leads: a candidate that holds few of the golden's tensors says so first.
    out << "  summary: ";
    if (rep.not_checked > 0) {
      out << rep.not_checked << " of " << rep.tensors.size() - static_cast<std::size_t>(rep.unknown)
          << " not checked (not in the candidate); " << rep.passed << " passed, " << rep.failed
          << " failed";
    } else {
      out << rep.passed << " passed, " << rep.failed << " failed, 0 not checked";
    }
    if (rep.unknown > 0)
      out << " (" << rep.unknown << " of them candidate names not in the golden)";
    if (rep.vacuous > 0) out << ", " << rep.vacuous << " vacuous (not judged)";
    if (rep.ambiguous > 0) out << ", " << rep.ambiguous << " ambiguous by routing (not judged)";
    if (rep.budget) {
      double worst = 0;
      for (const auto& t : rep.tensors)
        if (t.compared && (t.status == Status::pass || t.status == Status::fail))
          worst = std::max(worst, t.ratio);
      out << "; worst fraction of budget " << sci(worst);
    }
    out << "\n";
    if (!rep.ambiguous_tokens.empty()) {
      out << "  ambiguous routing: " << rep.ambiguous_tokens.size()
          << " token(s) routed otherwise within the " << rep.precision
          << " tolerance (a disagreement of rounding, not a wrong expert):\n";
      std::size_t shown = 0;
      for (const auto& a : rep.ambiguous_tokens) {
        if (++shown > 10) {
          out << "    ...\n";
          break;
        }
        out << "    " << (a.layer.empty() ? "" : a.layer + " ") << "token " << a.token
            << ": candidate [";
        for (std::size_t i = 0; i < a.candidate.size(); ++i)
          out << (i ? ", " : "") << a.candidate[i];
        out << "], golden [";
        for (std::size_t i = 0; i < a.golden.size(); ++i) out << (i ? ", " : "") << a.golden[i];
        out << "], margin " << sci(a.margin) << " <= tolerance " << sci(a.tolerance) << "\n";
      }
      out << "  router replay (a golden with input.moe.topk_ids) judges the experts alone\n";
    }
    if (!rep.optional_missing.empty()) {
      out << "  optional outputs not in the candidate (never required):";
      for (const auto& n : rep.optional_missing) out << " " << n;
      out << "\n";
    }
    if (!rep.not_in_golden.empty()) {
      out << "  not in golden (not kept by --keep; neither passed nor failed): "
          << rep.not_in_golden.size() << " tensor(s)\n";
    }
    if (!rep.extra.empty()) {
      out << "  extra candidate tensors, accepted by --allow-extra:";
      for (const auto& n : rep.extra) out << " " << n;
      out << "\n";
    }
    out << "\n";
    passed += rep.passed;
    failed += rep.failed;
    not_checked += rep.not_checked;
    cases_failed += rep.failed > 0;
  }
  const auto count = reports.size() - no_golden.size();
  out << "total: " << count << " case(s), " << cases_failed << " failing; tensors: " << passed
      << " passed, " << failed << " failed, " << not_checked << " not checked\n";
  for (const auto& [what, list] : {std::pair{"goldens with no candidate file", &no_candidate},
                                   std::pair{"candidate files with no golden", &no_golden}}) {
    if (list->empty()) continue;
    out << what << " (" << list->size() << "):";
    for (const auto& p : *list) out << " " << p;
    out << "\n";
  }
}

std::string junit_xml(const std::vector<CaseReport>& reports) {
  std::ostringstream o;
  int tests = 0, failures = 0, skipped = 0;
  for (const auto& r : reports) {
    tests += r.no_golden ? 1 : static_cast<int>(r.tensors.size());
    failures += r.no_golden ? !r.accepted : r.failed;
    skipped += r.no_golden ? r.accepted : r.not_checked + r.vacuous + r.ambiguous;
  }
  o << "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n";
  o << "<testsuites name=\"teo golden check\" tests=\"" << tests << "\" failures=\"" << failures
    << "\" skipped=\"" << skipped << "\">\n";
  for (const auto& r : reports) {
    if (r.no_golden) {
      const std::string why = "no golden of this name" +
                              (r.suggestion.empty() ? "" : "; did you mean " + r.suggestion + "?");
      o << "  <testsuite name=\"" << xml_escape(r.name) << "\" tests=\"1\" failures=\""
        << (r.accepted ? 0 : 1) << "\" skipped=\"" << (r.accepted ? 1 : 0) << "\">\n"
        << "    <testcase classname=\"" << xml_escape(r.name) << "\" name=\"candidate file\">"
        << (r.accepted ? "<skipped message=\"" : "<failure message=\"") << xml_escape(why)
        << "\"/></testcase>\n  </testsuite>\n";
      continue;
    }
    o << "  <testsuite name=\"" << xml_escape(r.name) << "\" tests=\"" << r.tensors.size()
      << "\" failures=\"" << r.failed << "\" skipped=\"" << r.not_checked + r.vacuous + r.ambiguous
      << "\">\n";
    if (!r.first_divergence.empty() || !r.ambiguous_tokens.empty()) {
      o << "    <properties>";
      if (!r.first_divergence.empty()) {
        o << "<property name=\"first_divergence\" value=\"" << xml_escape(r.first_divergence)
          << "\"/>";
      }
      for (const auto& a : r.ambiguous_tokens) {
        o << "<property name=\"ambiguous_token\" value=\""
          << xml_escape((a.layer.empty() ? "" : a.layer + " ") + "token " +
                        std::to_string(a.token) + " margin " + sci(a.margin) + " tolerance " +
                        sci(a.tolerance))
          << "\"/>";
      }
      o << "</properties>\n";
    }
    for (const auto& t : r.tensors) {
      o << "    <testcase classname=\"" << xml_escape(r.name) << "\" name=\"" << xml_escape(t.name)
        << "\">";
      const std::string detail = !t.compared
                                     ? t.mismatch
                                     : "max_abs=" + sci(t.max_abs) + " max_rel=" + sci(t.max_rel) +
                                           " bound=" + sci(t.bound) + " err/bound=" + sci(t.ratio);
      if (t.status == Status::fail) {
        o << "<failure message=\"" << xml_escape(t.message.empty() ? detail : t.message) << "\">"
          << xml_escape(detail) << "</failure>";
      } else if (t.status == Status::not_checked || t.status == Status::vacuous ||
                 t.status == Status::ambiguous) {
        o << "<skipped message=\"" << xml_escape(t.message) << "\"/>";
      }
      o << "</testcase>\n";
    }
    o << "  </testsuite>\n";
  }
  o << "</testsuites>\n";
  return o.str();
}

std::string json_report(const std::vector<CaseReport>& reports) {
  nlohmann::ordered_json cases = nlohmann::ordered_json::array();
  int passed = 0, failed = 0, not_checked = 0, vacuous = 0, ambiguous = 0;
  // Non-finite numbers are not JSON; an infinite ratio is written as null.
  auto number = [](double v) {
    return std::isfinite(v) ? nlohmann::ordered_json(v) : nlohmann::ordered_json(nullptr);
  };
  for (const auto& r : reports) {
    nlohmann::ordered_json c;
    c["name"] = r.name;
    if (r.no_golden) {
      c["candidate"] = r.candidate_path;
      c["no_golden"] = true;
      c["accepted"] = r.accepted;
      c["suggestion"] = r.suggestion.empty() ? nlohmann::ordered_json(nullptr)
                                             : nlohmann::ordered_json(r.suggestion);
      cases.push_back(std::move(c));
      continue;
    }
    c["golden"] = r.golden_path;
    c["candidate"] = r.candidate_path;
    c["first_divergence"] = r.first_divergence.empty() ? nlohmann::ordered_json(nullptr)
                                                       : nlohmann::ordered_json(r.first_divergence);
    c["precision"] = r.precision;
    c["notes"] = r.notes;
    if (r.budget) c["emulated_bytes"] = r.emulated_bytes;
    if (r.precision == "fp8") c["recipe_rule"] = r.recipe_rule;
    c["passed"] = r.passed;
    c["failed"] = r.failed;
    c["not_checked"] = r.not_checked;
    c["vacuous"] = r.vacuous;
    c["ambiguous"] = r.ambiguous;
    auto tokens = nlohmann::ordered_json::array();
    for (const auto& a : r.ambiguous_tokens) {
      nlohmann::ordered_json aj;
      aj["layer"] =
          a.layer.empty() ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(a.layer);
      aj["token"] = a.token;
      aj["margin"] = number(a.margin);
      aj["tolerance"] = number(a.tolerance);
      aj["golden"] = a.golden;
      aj["candidate"] = a.candidate;
      tokens.push_back(std::move(aj));
    }
    c["ambiguous_tokens"] = std::move(tokens);
    auto ts = nlohmann::ordered_json::array();
    for (const auto& t : r.tensors) {
      nlohmann::ordered_json tj;
      tj["name"] = t.name;
      tj["status"] = t.status == Status::pass        ? "pass"
                     : t.status == Status::fail      ? "fail"
                     : t.status == Status::vacuous   ? "vacuous"
                     : t.status == Status::ambiguous ? "ambiguous"
                                                     : "not_checked";
      if (t.status != Status::not_checked && !t.compared) {
        // nothing was compared: the numbers do not exist
        for (const char* k : {"max_abs", "max_rel", "bound", "ratio"}) tj[k] = nullptr;
        tj["mismatch"] = t.mismatch;
      } else if (t.status != Status::not_checked) {
        tj["max_abs"] = number(t.max_abs);
        tj["max_rel"] = number(t.max_rel);
        tj["bound"] = number(t.bound);
        tj["ratio"] = number(t.ratio);
        if (r.budget) tj["emulated_err"] = number(t.emulated_err);
        if (r.precision == "fp8") tj["recipe_distance"] = number(t.recipe_distance);
      }
      tj["vacuous"] = t.status == Status::vacuous;
      if (!t.message.empty()) tj["message"] = t.message;
      if (!t.excluded.empty()) tj["excluded"] = t.excluded;
      ts.push_back(std::move(tj));
    }
    c["tensors"] = std::move(ts);
    if (!r.optional_missing.empty()) c["optional_missing"] = r.optional_missing;
    if (!r.not_in_golden.empty()) c["not_in_golden"] = r.not_in_golden;
    c["unknown"] = r.unknown;
    if (!r.extra.empty()) c["extra"] = r.extra;
    cases.push_back(std::move(c));
    passed += r.passed;
    failed += r.failed;
    not_checked += r.not_checked;
    vacuous += r.vacuous;
    ambiguous += r.ambiguous;
  }
  nlohmann::ordered_json j;
  j["format"] = "teo-golden-check/1";
  j["passed"] = passed;
  j["failed"] = failed;
  j["not_checked"] = not_checked;
  j["vacuous"] = vacuous;
  j["ambiguous"] = ambiguous;
  j["cases"] = std::move(cases);
  return j.dump(2) + "\n";
}

Verdict verdict(const std::vector<CaseReport>& reports, bool require_all) {
  int failed = 0, passed = 0, not_checked = 0, vacuous = 0, ambiguous = 0;
  std::string orphans, examined;
  int examined_count = 0;
  for (const auto& r : reports) {
    if (r.no_golden) {
      if (!r.accepted) orphans += (orphans.empty() ? "" : ", ") + r.candidate_path;
      continue;
    }
    failed += r.failed;
    passed += r.passed;
    not_checked += r.not_checked;
    vacuous += r.vacuous;
    ambiguous += r.ambiguous;
    if (!r.no_candidate && ++examined_count <= 3)
      examined += (examined.empty() ? "" : ", ") + r.candidate_path;
  }
  if (failed > 0) return {1, ""};  // the report names them
  if (!orphans.empty()) {
    return {1, "candidate file(s) with no golden of their name: " + orphans +
                   " (--allow-extra accepts them)"};
  }
  if (passed == 0 && vacuous > 0 && ambiguous == 0)
    return {1, "every judged tensor's budget is vacuous"};
  if (passed == 0 && ambiguous > 0)
    return {1, "no tensor passed: every judged one is vacuous or ambiguous by routing"};
  if (passed == 0 && examined_count == 0)
    return {1, "nothing was checked: no golden has a candidate file of its name"};
  if (passed == 0) {
    return {1, "nothing was checked: " +
                   (examined_count == 1 ? "the candidate " + examined + " holds"
                                        : "the candidate files " + examined +
                                              (examined_count > 3 ? ", ..." : "") + " hold") +
                   " none of the golden's tensors"};
  }
  if (require_all && not_checked > 0) {
    return {1, std::to_string(not_checked) + " tensor(s) not checked, and --require-all was given"};
  }
  if (require_all && vacuous > 0) {
    return {1, std::to_string(vacuous) +
                   " tensor(s) with a vacuous budget (not judged), and --require-all was given"};
  }
  if (require_all && ambiguous > 0) {
    return {1, std::to_string(ambiguous) +
                   " tensor(s) ambiguous by routing (not judged), and --require-all was given: "
                   "router replay (input.moe.topk_ids) judges the experts alone"};
  }
  if (vacuous > 0 || ambiguous > 0) {
    std::string w = "warning: ";
    if (vacuous > 0)
      w += std::to_string(vacuous) + " tensor(s) with a vacuous budget were not judged";
    if (vacuous > 0 && ambiguous > 0) w += "; ";
    if (ambiguous > 0) {
      w += std::to_string(ambiguous) +
           " tensor(s) ambiguous by routing were not judged (router replay judges the experts)";
    }
    return {0, w};
  }
  return {};
}

}  // namespace teo::golden
