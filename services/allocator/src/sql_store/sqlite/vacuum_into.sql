-- A consistent copy of the whole file (one read transaction), for reading a
-- file of an older schema without changing it.
VACUUM INTO $1
