"""The SGLang hooks: the hook table and its rooms, the only modules of the plugin that name SGLang internals.

- `table`: which SGLang targets the plugin hooks (`HOOKS`), and `install`, which registers them behind guards.
- `capture`: the device cache sized for the worst forward, sync-free DP slicing, each write checked.
- `budget`: the buffer budget checked at the last `ServerArgs` resolution step.
- `delivery`: finished rows to the spool, off the scheduler thread (scheduler).
- `live`: one batch's layout and requests for live rows (scheduler).
- `frontdoor`: the pointer and the inline rows' shape in responses (main process, tokenizer workers).

This file imports nothing, so a room imports without the table (`r3-budget` takes `budget` without SGLang's
plugin registry); importing the table imports every room.
"""
