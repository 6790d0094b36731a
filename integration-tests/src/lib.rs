//! Tests across real processes on loopback and across containers.
