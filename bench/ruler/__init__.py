"""`kvchat bench ruler`: RULER's task suite, generated offline from RULER's own data."""
