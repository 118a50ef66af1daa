"""Planning, pure: what a save writes and what a load reads, decided before any byte moves.

Save side: ``collecting`` (a state dict into entries and chunks) -> ``offer`` (each rank's
chunks, as shapes) -> ``save_plan`` (every data file and who writes it; ``plan_parts``: the
part each rank needs; ``transfers``: the messages of the consolidated layout). Load side:
``load_plan`` (what each entry's adapter reads, checked against the manifest).
"""
