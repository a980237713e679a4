// Files as teo writes them: whole or not at all.
#pragma once

#include <string>
#include <string_view>

#include <nlohmann/json_fwd.hpp>

namespace teo {

// Writes `bytes` to `path` through a temporary file in the same directory and a rename, so that a
// reader never sees half a file. Without `overwrite`, an existing `path` is a FileError; so are a
// missing directory and a failed write, which leave no temporary file behind.
void write_file_atomic(const std::string& path, std::string_view bytes, bool overwrite);

// The JSON value in file `path`: FileError when it is missing or unreadable, ConfigError naming
// the path when it is not valid JSON.
nlohmann::json read_json_file(const std::string& path);

// Creates directory `dir` (and its parents) when missing and proves it writable by creating and
// removing a temporary file in it; FileError naming `dir` otherwise. For checking where a long
// computation will write before it starts.
void ensure_writable_dir(const std::string& dir);

}  // namespace teo
