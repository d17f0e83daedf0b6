// A minimal test harness for the C++ unit tests (no dependency beyond the standard library).
#pragma once
#include <cstdio>
#include <exception>
#include <functional>
#include <string>
#include <vector>

namespace specdec_test {

struct Case {
  const char* name;
  std::function<void()> fn;
};
inline std::vector<Case>& cases() {
  static std::vector<Case> all;
  return all;
}
struct Register {
  Register(const char* name, std::function<void()> fn) { cases().push_back({name, std::move(fn)}); }
};
struct Failure : std::exception {
  std::string what_;
  explicit Failure(std::string w) : what_(std::move(w)) {}
  const char* what() const noexcept override { return what_.c_str(); }
};

// Runs every registered case (or those whose name contains argv[1]); prints "N passed, M failed".
inline int run_all(int argc, char** argv) {
  int passed = 0, failed = 0;
  for (const Case& c : cases()) {
    if (argc > 1 && std::string(c.name).find(argv[1]) == std::string::npos) continue;
    try {
      c.fn();
      ++passed;
      std::printf("PASS %s\n", c.name);
      std::fflush(stdout);
    } catch (const std::exception& e) {
      ++failed;
      std::printf("FAIL %s: %s\n", c.name, e.what());
      std::fflush(stdout);
    }
  }
  std::printf("%d passed, %d failed\n", passed, failed);
  return failed == 0 && passed > 0 ? 0 : 1;
}

}  // namespace specdec_test

#define SPECDEC_CONCAT_(a, b) a##b
#define SPECDEC_CONCAT(a, b) SPECDEC_CONCAT_(a, b)
#define TEST_CASE(name)                                                                          \
  static void SPECDEC_CONCAT(test_fn_, __LINE__)();                                            \
  static specdec_test::Register SPECDEC_CONCAT(test_reg_, __LINE__)(name, SPECDEC_CONCAT(test_fn_, __LINE__)); \
  static void SPECDEC_CONCAT(test_fn_, __LINE__)()
#define CHECK(cond)                                                                              \
  do {                                                                                           \
    if (!(cond)) throw specdec_test::Failure(std::string(__FILE__) + ":" + std::to_string(__LINE__) + ": CHECK(" #cond ") failed"); \
  } while (0)
#define CHECK_EQ(a, b)                                                                           \
  do {                                                                                           \
    const auto va = (a);                                                                         \
    const auto vb = (b);                                                                         \
    if (!(va == vb))                                                                             \
      throw specdec_test::Failure(std::string(__FILE__) + ":" + std::to_string(__LINE__) + ": " #a " == " #b ": " + \
                                  std::to_string(va) + " != " + std::to_string(vb));             \
  } while (0)
#define CHECK_THROWS_WITH(stmt, substring)                                                       \
  do {                                                                                           \
    bool thrown = false;                                                                         \
    try {                                                                                        \
      stmt;                                                                                      \
    } catch (const std::exception& e) {                                                          \
      thrown = true;                                                                             \
      if (std::string(e.what()).find(substring) == std::string::npos)                            \
        throw specdec_test::Failure(std::string(__FILE__) + ":" + std::to_string(__LINE__) + ": error \"" + e.what() + \
                                    "\" does not mention \"" substring "\"");                    \
    }                                                                                            \
    if (!thrown) throw specdec_test::Failure(std::string(__FILE__) + ":" + std::to_string(__LINE__) + ": " #stmt " did not throw"); \
  } while (0)
