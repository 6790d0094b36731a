//! Per-vdev agent: owns one device (file, block device or simulated), does the data I/O, reports to the allocator.
