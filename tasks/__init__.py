"""Pipeline stages: one module per stage, each with one typed core function."""
