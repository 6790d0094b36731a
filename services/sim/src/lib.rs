//! Virtual-time simulator of a pool on crates/metaslab.
