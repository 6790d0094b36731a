PRAGMA quick_check(5)
