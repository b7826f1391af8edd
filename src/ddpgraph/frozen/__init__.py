"""Python values a replay would freeze: watched at warm-up and checked after capture."""
