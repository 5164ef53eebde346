"""Small process-level helpers that every layer may use, importing nothing of tandem: tensor storage freed and
restored in place (`residency`), the global RNGs' state (`rng`), a free port to listen on (`net`), an image
file decoded into the RGB pixels every consumer sees (`pixels`)."""
