"""What the tests share: configs, leak checks, torchrun launches, the Lightning app."""
