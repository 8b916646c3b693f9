// JSON from files from elsewhere (checkpoint/json.h): its bounds, its refusals, and json_text,
// the compact form an index's checksum is computed over.

#include <gtest/gtest.h>

#include <string>

#include "torch_mp/checkpoint/json.h"

namespace {

using torch_mp::checkpoint::json_text;
using torch_mp::checkpoint::JsonValue;
using torch_mp::checkpoint::kMaxJsonDepth;
using torch_mp::checkpoint::parse_json;

std::string refusal(const std::string& text,
                    int max_depth = kMaxJsonDepth,
                    int64_t max_values = torch_mp::checkpoint::kMaxJsonValues) {
  try {
    parse_json(text, "input", max_depth, max_values);
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

std::string nested(int depth) { return std::string(depth, '[') + std::string(depth, ']'); }

TEST(CheckpointJson, NestingStopsAtTheSafetensorsPackagesLimit) {
  EXPECT_EQ(refusal(nested(kMaxJsonDepth)), "");
  EXPECT_NE(refusal(nested(kMaxJsonDepth + 1)).find("nested deeper than 127 levels"),
            std::string::npos);
  // A text far deeper than any stack allows is refused, not a crash.
  EXPECT_NE(refusal(std::string(1'000'000, '[')).find("nested deeper"), std::string::npos);
}

TEST(CheckpointJson, ValuesAreCountedAndBounded) {
  EXPECT_EQ(refusal("[1,2,3]", kMaxJsonDepth, 4), "");  // three numbers and the array
  EXPECT_NE(refusal("[1,2,3,4]", kMaxJsonDepth, 4).find("more than 4 values"), std::string::npos);
}

TEST(CheckpointJson, MalformedTextIsRefusedByName) {
  for (const std::string text : {"+8",
                                 "01",
                                 "[1,]",
                                 "{'a':1}",
                                 "\"\x01\"",
                                 "\"\\ud800\"",
                                 "\"\xff\"",
                                 "1e999",
                                 "[1] x",
                                 "NaN",
                                 ""}) {
    const auto why = refusal(text);
    EXPECT_NE(why.find("input: "), std::string::npos) << text;
  }
  // A NUL ends nlohmann/json's input: what follows it must not be ignored.
  EXPECT_NE(refusal(std::string("{}\0x", 4)).find("a NUL byte (at byte 2)"), std::string::npos);
}

TEST(CheckpointJson, NumbersKeepTheirTextAndCountsTheirValue) {
  const auto v = parse_json("[0, -0, 18446744073709551615, 18446744073709551616, 1.5, 2e3]", "");
  ASSERT_EQ(v.array.size(), 6u);
  EXPECT_EQ(v.array[0].count, 0u);
  EXPECT_FALSE(v.array[1].count.has_value());  // -0 is no size (the safetensors package agrees)
  EXPECT_EQ(v.array[2].count, UINT64_MAX);
  EXPECT_FALSE(v.array[3].count.has_value());  // beyond 64 bits
  EXPECT_FALSE(v.array[4].count.has_value());
  EXPECT_FALSE(v.array[5].count.has_value());
  EXPECT_EQ(json_text(v), "[0,-0,18446744073709551615,18446744073709551616,1.5,2e3]");
}

TEST(CheckpointJson, RepeatedKeysAreKeptForTheFileRulesToJudge) {
  const auto v = parse_json(R"({"a": 1, "b": 2, "a": 3})", "");
  EXPECT_EQ(v.members.size(), 3u);
  EXPECT_EQ(v.repeated_key(), "a");
  EXPECT_EQ(v.find("a")->text, "3");  // the last
}

TEST(CheckpointJson, TextIsCompactAndEscapedAsPythonsJsonDumps) {
  // json.dumps(v, ensure_ascii=False, separators=(",", ":")) writes the same.
  const auto v =
      parse_json("{ \"k\\u00e9\" : [ \"a\\\"\\\\\\n\\t\\u0001\\u0000\\/\", true , null ] }", "");
  EXPECT_EQ(json_text(v), "{\"k\xc3\xa9\":[\"a\\\"\\\\\\n\\t\\u0001\\u0000/\",true,null]}");
}

}  // namespace
