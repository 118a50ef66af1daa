"""The checkpoint engine: format, planning, I/O and the save/load phases."""
