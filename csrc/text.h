// Error messages without C++ streams. On the H200 machine (torch 2.11, bench/RESULTS.md
// 2026-11-30 16:35) formatting an integer through std::ostringstream in this extension —
// c10::str, hence every TORCH_CHECK with a number in its message — killed the process with
// SIGSEGV even when nothing was thrown, while messages of strings only, thrown exceptions
// and libtorch's own formatting worked (bench/registration_errors.py: _C._error_path_probe).
// Messages here are built by concatenation and std::to_string; the checks hand TORCH_CHECK
// a finished C string, the path proven there.
#pragma once

#include <c10/util/Exception.h>

#include <string>
#include <type_traits>

namespace lycoris {

inline std::string to_text(const std::string& s) { return s; }
inline std::string to_text(const char* s) { return s; }
template <class T, std::enable_if_t<std::is_arithmetic_v<T>, int> = 0>
std::string to_text(T v) {
  if constexpr (std::is_same_v<T, bool>) return v ? "true" : "false";
  else return std::to_string(v);
}

// The concatenation of the arguments (strings, C strings, numbers) as text.
template <class... Args>
std::string text(const Args&... args) {
  std::string out;
  (out.append(to_text(args)), ...);
  return out;
}

}  // namespace lycoris

// TORCH_CHECK(cond, parts...) with the message built by lycoris::text (c10::Error, RuntimeError in Python).
#define LYCORIS_CHECK(cond, ...)                                        \
  do {                                                                  \
    if (!(cond)) TORCH_CHECK(false, ::lycoris::text(__VA_ARGS__).c_str()); \
  } while (0)
