//! Balance history in SQLite, queries and SVG charts.
