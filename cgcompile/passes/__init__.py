"""Pure FX passes: op matching and splitting. No CUDA, no backend imports here."""
