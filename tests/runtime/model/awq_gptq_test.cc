// Placeholder: replaced by the tests of this file's change.
#include <gtest/gtest.h>

TEST(Placeholder, Empty) {}
