"""The on-disk format, and nothing else: what a checkpoint's bytes mean and how they are
checked as hostile input.

``manifest`` (the file that makes a directory a checkpoint: written by
:meth:`~.manifest.Manifest.to_json`, read by :func:`~.manifest.parse`) with
``manifest_format`` (its constants and records), ``manifest_checks`` (version 1's
per-record checks) and ``strict_json``; format version 2's binary chunk table in
``manifest_table`` (checked by ``table_checks``, ``table_layout``, ``table_tiling``);
``safetensors_header`` (a data file's header); ``tensor_bytes`` (a tensor's bytes as
stored); ``crc`` (the checksums) and ``geometry`` (boxes and tilings).

Imports nothing above it: not ``storage``, ``plan`` or ``io``, nor the phases (a test
pins this), so every reader of the format (load, verify, inspect, the converters) trusts
the same checks.
"""
