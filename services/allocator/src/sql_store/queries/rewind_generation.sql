SELECT rewind_generation FROM pools WHERE id = $1
