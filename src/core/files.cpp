#include "teo/files.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "teo/errors.hpp"

namespace teo {

MappedFile map_readonly(const std::string& path, std::uint64_t max_bytes) {
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);
  if (ec || !std::filesystem::exists(status)) throw FileError(path + ": no such file");
  if (!std::filesystem::is_regular_file(status)) throw FileError(path + ": not a regular file");
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw FileError(path + ": cannot open for reading: " + std::strerror(errno));
  // The size of what was opened, not of what the path named a moment before.
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const std::string why = std::strerror(errno);
    ::close(fd);
    throw FileError(path + ": cannot read its size: " + why);
  }
  const auto size = static_cast<std::uint64_t>(st.st_size);
  if (size > max_bytes) {
    ::close(fd);
    throw FormatError(path + ": the file is " + std::to_string(size) +
                      " bytes, more than the limit of " + std::to_string(max_bytes));
  }
  if (size == 0) {
    ::close(fd);
    return {};
  }
  void* p = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  const int map_errno = errno;
  ::close(fd);
  if (p == MAP_FAILED) throw FileError(path + ": cannot map: " + std::strerror(map_errno));
  MappedFile m;
  m.backing = std::shared_ptr<const void>(
      p, [size](const void* q) { ::munmap(const_cast<void*>(q), size); });
  m.bytes = std::string_view(static_cast<const char*>(p), size);
  return m;
}

std::pair<int, std::string> open_temp_beside(const std::string& path, bool overwrite) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path target(path);
  if (fs::is_directory(target, ec)) throw FileError(path + ": is a directory");
  if (!overwrite && fs::exists(target, ec)) {
    throw FileError(path + ": already exists (pass --force to overwrite it)");
  }
  const fs::path dir = target.has_parent_path() ? target.parent_path() : fs::path(".");
  if (!fs::is_directory(dir, ec)) throw FileError(path + ": the directory does not exist");
  std::string tmp = (dir / ("." + target.filename().string() + ".tmp-XXXXXX")).string();
  const int fd = ::mkstemp(tmp.data());
  if (fd < 0) throw FileError(path + ": cannot create a temporary file: " + std::strerror(errno));
  return {fd, tmp};
}

void commit_temp(int fd, const std::string& tmp, const std::string& path, bool overwrite) {
  // The temporary file is private (0600); the result gets the usual permissions.
  ::fchmod(fd, 0644);
  const bool synced = ::fsync(fd) == 0;
  const int sync_errno = errno;
  const bool closed = ::close(fd) == 0;  // always, whether or not the sync failed
  if (!synced || !closed) {
    const std::string why = std::strerror(synced ? errno : sync_errno);
    ::unlink(tmp.c_str());
    throw FileError(path + ": write failed: " + why);
  }
  std::error_code ec;
  if (!overwrite && std::filesystem::exists(path, ec)) {
    ::unlink(tmp.c_str());
    throw FileError(path + ": already exists (pass --force to overwrite it)");
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string why = std::strerror(errno);
    ::unlink(tmp.c_str());
    throw FileError(path + ": cannot rename the temporary file into place: " + why);
  }
}

bool write_all_at(int fd, const void* bytes, std::size_t size, std::uint64_t offset) {
  const auto* p = static_cast<const char*>(bytes);
  std::size_t done = 0;
  while (done < size) {
    const ssize_t w = ::pwrite(fd, p + done, size - done, static_cast<off_t>(offset + done));
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      if (w == 0) errno = EIO;
      return false;
    }
    done += static_cast<std::size_t>(w);
  }
  return true;
}

void write_file_atomic(const std::string& path, std::string_view bytes, bool overwrite) {
  const auto [fd, tmp] = open_temp_beside(path, overwrite);
  if (!write_all_at(fd, bytes.data(), bytes.size(), 0)) {
    const std::string why = std::strerror(errno);
    ::close(fd);
    ::unlink(tmp.c_str());
    throw FileError(path + ": write failed: " + why);
  }
  commit_temp(fd, tmp, path, overwrite);
}

nlohmann::json read_json_file(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) throw FileError(path + ": no such file");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw FileError(path + ": cannot open for reading");
  std::stringstream ss;
  ss << in.rdbuf();
  try {
    return nlohmann::json::parse(ss.str());
  } catch (const nlohmann::json::exception& e) {
    throw ConfigError(path + ": not valid JSON: " + e.what());
  }
}

void ensure_writable_dir(const std::string& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path d = dir.empty() ? fs::path(".") : fs::path(dir);
  if (!fs::is_directory(d, ec)) {
    if (fs::exists(d, ec)) throw FileError(dir + ": exists and is not a directory");
    if (!fs::create_directories(d, ec) && ec) {
      throw FileError(dir + ": cannot create the directory: " + ec.message());
    }
  }
  std::string probe = (d / ".teo-write-test-XXXXXX").string();
  const int fd = ::mkstemp(probe.data());
  if (fd < 0) throw FileError(dir + ": cannot write in the directory: " + std::strerror(errno));
  ::close(fd);
  ::unlink(probe.c_str());
}

}  // namespace teo
