UPDATE pools SET rewind_generation = $1 WHERE id = $2
