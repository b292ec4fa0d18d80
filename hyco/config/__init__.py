"""What a run is asked to do: the typed recipe (`recipe`) and the model families it may name
(`families`). Imports only hyco.base."""
