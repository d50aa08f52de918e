"""Banks of student-style implementations (correct and buggy) that the checker tests run against."""
