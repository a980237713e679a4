// Files as teo writes them: whole or not at all.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>

#include <nlohmann/json_fwd.hpp>

namespace teo {

// Writes `bytes` to `path` through a temporary file in the same directory and a rename, so that a
// reader never sees half a file. Without `overwrite`, an existing `path` is a FileError; so are a
// missing directory and a failed write, which leave no temporary file behind.
void write_file_atomic(const std::string& path, std::string_view bytes, bool overwrite);

// The two halves of write_file_atomic for a file written piece by piece. open_temp_beside checks
// `path` as write_file_atomic does and creates the private temporary file beside it: {fd, its
// path}. commit_temp gives it the usual permissions, syncs and closes it and renames it to `path`;
// on failure it removes the temporary file and throws FileError.
std::pair<int, std::string> open_temp_beside(const std::string& path, bool overwrite);
void commit_temp(int fd, const std::string& tmp, const std::string& path, bool overwrite);

// Writes all of `bytes` at `offset` of `fd` (pwrite, retried); false with errno set on failure.
bool write_all_at(int fd, const void* bytes, std::size_t size, std::uint64_t offset);

// A regular file mapped read-only: its bytes live as long as `backing` (or a copy of it) does. An
// empty file has no mapping (bytes is empty).
struct MappedFile {
  std::shared_ptr<const void> backing;
  std::string_view bytes;
};
// Maps `path`. FileError when it is missing, not a regular file, or cannot be opened or mapped;
// FormatError when it is longer than max_bytes ("PATH: the file is N bytes, more than the limit of
// M"), checked on what was opened.
MappedFile map_readonly(const std::string& path, std::uint64_t max_bytes);

// The JSON value in file `path`: FileError when it is missing or unreadable, ConfigError naming
// the path when it is not valid JSON.
nlohmann::json read_json_file(const std::string& path);

// Creates directory `dir` (and its parents) when missing and proves it writable by creating and
// removing a temporary file in it; FileError naming `dir` otherwise. For checking where a long
// computation will write before it starts.
void ensure_writable_dir(const std::string& dir);

}  // namespace teo
