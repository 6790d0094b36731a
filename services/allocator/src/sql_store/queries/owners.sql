SELECT idx, identity FROM owners WHERE pool = $1 ORDER BY idx
