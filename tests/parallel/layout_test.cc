#include "parallel/layout.h"

#include <gtest/gtest.h>

#include <sstream>

namespace mlarun {
namespace {

ParallelLayout Parse(std::string_view text) {
  auto layout = ParseParallelLayout(text);
  EXPECT_TRUE(layout.ok()) << text << ": " << layout.status();
  return layout.ok() ? *layout : ParallelLayout{};
}

std::string Print(const ParallelLayout& l) {
  std::ostringstream os;
  os << l;
  return os.str();
}

TEST(ParallelLayout, ParsesValidForms) {
  EXPECT_EQ(Parse("dp=2,attn_tp=2"), (ParallelLayout{.dp = 2, .attn_tp = 2}));
  EXPECT_EQ(Parse("attn_tp=4"), (ParallelLayout{.dp = 1, .attn_tp = 4}));
  EXPECT_EQ(Parse("dp=4"), (ParallelLayout{.dp = 4, .attn_tp = 1}));
  EXPECT_EQ(Parse("dp=2,attn_tp=2,moe=intermediate"),
            (ParallelLayout{.dp = 2, .attn_tp = 2, .moe = MoeSharding::kByIntermediate}));
  EXPECT_EQ(Parse("moe=expert,attn_tp=8,dp=3"), (ParallelLayout{.dp = 3, .attn_tp = 8}));
  EXPECT_EQ(Parse(" dp = 2 , attn_tp=2 "), (ParallelLayout{.dp = 2, .attn_tp = 2}));
  EXPECT_EQ(Parse("dp=4096"), (ParallelLayout{.dp = 4096}));
  EXPECT_EQ(Parse(""), ParallelLayout{});
}

// The short names of `mlarun memory` are the same layouts as the key=value
// form, alone or with moe=.
TEST(ParallelLayout, ParsesShortForms) {
  EXPECT_EQ(Parse("tp8"), Parse("attn_tp=8"));
  EXPECT_EQ(Parse("tp8"), (ParallelLayout{.dp = 1, .attn_tp = 8}));
  EXPECT_EQ(Parse("dp4"), (ParallelLayout{.dp = 4, .attn_tp = 1}));
  EXPECT_EQ(Parse("dp2xtp4"), Parse("dp=2,attn_tp=4"));
  EXPECT_EQ(Parse("dp3xtp2"), (ParallelLayout{.dp = 3, .attn_tp = 2}));
  EXPECT_EQ(Parse("dp2xtp4,moe=intermediate"),
            (ParallelLayout{.dp = 2, .attn_tp = 4, .moe = MoeSharding::kByIntermediate}));
  EXPECT_EQ(Parse(" dp2 , attn_tp=4"), (ParallelLayout{.dp = 2, .attn_tp = 4}));
  EXPECT_EQ(Parse("tp4096"), (ParallelLayout{.attn_tp = 4096}));
  EXPECT_EQ(Parse("dp1"), ParallelLayout{});
}

TEST(ParallelLayout, PrintsCanonicalForm) {
  EXPECT_EQ(Print(ParallelLayout{.dp = 2, .attn_tp = 2}), "dp=2,attn_tp=2,moe=expert");
  EXPECT_EQ(Print(ParallelLayout{.dp = 1, .attn_tp = 4, .moe = MoeSharding::kByIntermediate}),
            "dp=1,attn_tp=4,moe=intermediate");
  // The printed form parses back to the same layout.
  const ParallelLayout l{.dp = 3, .attn_tp = 2, .moe = MoeSharding::kByIntermediate};
  EXPECT_EQ(Parse(Print(l)), l);
}

TEST(ParallelLayout, ErrorsNameTheBadPart) {
  struct Case {
    std::string text;
    std::string part;  // must appear in the message, quoted
    std::string why;
  };
  const Case cases[] = {
      {"dp=2,tp=2", "\"tp=2\"", "unknown key"},
      {"dp=2,dp=4", "\"dp=4\"", "duplicate key"},
      {"attn_tp=2,moe=expert,moe=expert", "\"moe=expert\"", "duplicate key"},
      {"pp2", "\"pp2\"", "key=value, or tpN, dpN or dpAxtpB"},
      {"dp2x4", "\"dp2x4\"", "not a positive integer"},
      {"dp2xtp", "\"dp2xtp\"", "key=value, or tpN"},
      {"dpxtp4", "\"dpxtp4\"", "key=value, or tpN"},
      {"tp", "\"tp\"", "not a positive integer"},
      {"tp0", "\"tp0\"", "must be positive"},
      {"tp-2", "\"tp-2\"", "not a positive integer"},
      {"dp5000", "\"dp5000\"", "exceeds 4096"},
      {"dp2,dp=4", "\"dp=4\"", "duplicate key"},
      {"attn_tp=2,dp2xtp4", "\"dp2xtp4\"", "duplicate key"},
      {"dp=two", "\"dp=two\"", "not a positive integer"},
      {"dp=2.5", "\"dp=2.5\"", "not a positive integer"},
      {"attn_tp=", "\"attn_tp=\"", "not a positive integer"},
      {"dp=0", "\"dp=0\"", "must be positive"},
      {"dp=-2", "\"dp=-2\"", "not a positive integer"},
      {"dp=+2", "\"dp=+2\"", "not a positive integer"},
      {"attn_tp=4097", "\"attn_tp=4097\"", "exceeds 4096"},
      {"dp=99999999999999999999", "\"dp=99999999999999999999\"", "exceeds 4096"},
      {"dp=2,moe=tensor", "\"moe=tensor\"", "expert or intermediate"},
      {"dp=2,,attn_tp=2", "\"\"", "empty part"},
      {"dp=2,", "\"\"", "empty part"},
  };
  for (const Case& c : cases) {
    const auto layout = ParseParallelLayout(c.text);
    ASSERT_FALSE(layout.ok()) << c.text;
    EXPECT_EQ(layout.status().code(), StatusCode::kInvalidArgument) << c.text;
    const std::string& msg = layout.status().message();
    EXPECT_NE(msg.find(c.part), std::string::npos) << c.text << " -> " << msg;
    EXPECT_NE(msg.find(c.why), std::string::npos) << c.text << " -> " << msg;
  }
}

TEST(ParallelLayout, RanksOfDp2AttnTp2) {
  const ParallelLayout l{.dp = 2, .attn_tp = 2};
  EXPECT_EQ(l.world(), 4);
  const int dp_rank[] = {0, 0, 1, 1};
  const int attn_tp_rank[] = {0, 1, 0, 1};
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(l.dp_rank(r), dp_rank[r]) << r;
    EXPECT_EQ(l.attn_tp_rank(r), attn_tp_rank[r]) << r;
  }
  EXPECT_EQ(l.leader_of(0), 0);
  EXPECT_EQ(l.leader_of(1), 2);
}

TEST(ParallelLayout, RanksOfAttnTp4AndDp4) {
  const ParallelLayout tp{.dp = 1, .attn_tp = 4};
  const ParallelLayout dp{.dp = 4, .attn_tp = 1};
  EXPECT_EQ(tp.world(), 4);
  EXPECT_EQ(dp.world(), 4);
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(tp.dp_rank(r), 0);
    EXPECT_EQ(tp.attn_tp_rank(r), r);
    EXPECT_EQ(dp.dp_rank(r), r);
    EXPECT_EQ(dp.attn_tp_rank(r), 0);
    EXPECT_EQ(dp.leader_of(r), r);
  }
  EXPECT_EQ(tp.leader_of(0), 0);
}

TEST(ParallelLayout, ProcessGroupsAccessors) {
  ProcessGroups g;
  g.layout = ParallelLayout{.dp = 2, .attn_tp = 2};
  g.rank = 3;
  EXPECT_EQ(g.dp_rank(), 1);
  EXPECT_EQ(g.attn_tp_rank(), 1);
  EXPECT_FALSE(g.is_leader());
  g.rank = 2;
  EXPECT_TRUE(g.is_leader());
}

}  // namespace
}  // namespace mlarun
