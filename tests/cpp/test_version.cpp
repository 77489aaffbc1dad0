#include <posenc/posenc.h>

#include <gtest/gtest.h>

#include <fstream>
#include <string>

// posenc::version(), its C name, the header's macros and the file VERSION (CMake's and setup.py's source)
// say the same; tests/python/test_version.py checks Python's posenc.__version__ against the same file.
TEST(Version, LibraryHeaderAndVersionFileAgree) {
  std::ifstream file(POSENC_VERSION_FILE);
  std::string expected;
  ASSERT_TRUE(std::getline(file, expected)) << POSENC_VERSION_FILE;
  EXPECT_EQ(posenc::version(), expected);
  EXPECT_EQ(posenc_version(), expected);
  EXPECT_EQ(POSENC_VERSION, expected);
  EXPECT_EQ(std::to_string(POSENC_VERSION_MAJOR) + "." + std::to_string(POSENC_VERSION_MINOR) + "." +
                std::to_string(POSENC_VERSION_PATCH),
            expected);
}
