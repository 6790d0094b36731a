//! aliquotctl: local pool, status, tunables, write load generator, demo.
