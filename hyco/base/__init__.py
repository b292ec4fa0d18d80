"""What every room may use: errors and their exit codes, reading inputs (`loading`), files and
memory figures, processes and ranks (`launch`, `workers`), the console, the private names of
torch and transformers. Imports nothing else of hyco."""
